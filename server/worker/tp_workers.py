"""Tensor-parallel ranks 1..N-1, each in a process of its own on this host or another, driven by rank 0.

::

    node 0: engine process (rank 0, the driver)           node n (``serve --headless``): rank r
    ───────────────────────────────────────────           ─────────────────────────────────────
    scheduler, block manager, Executor                    ModelRunner with TPGroup(r, N)
    ModelRunner with TPGroup(0, N) ──TCP (rank_channel)─► one message per step: ("step", SchedulerOutput)
            │  all-reduce / gather inside the model (gloo on CPU, NCCL on CUDA)  │
            └───────────────────────────────────────────────────────────────────┘

Ranks are dealt out in blocks, ``tensor_parallel_size / nnodes`` per node: node 0 holds
rank 0 (this process) and starts its other ranks itself; node n runs ranks
``n*k .. n*k+k-1`` (:mod:`pagedllm.server.worker.tp_rank`). Every rank, local or remote,
reaches the driver through the same TCP channel, so single-host and multi-host tensor
parallelism are one code path. NOTE: measured (``python -m benchmarks.tp``, 2-core CPU):
a decode step reaches a local rank in 0.12-0.19 ms over TCP against 0.06-0.09 ms over a
multiprocessing pipe (one more thread hand-off on the rank, which lets it notice a lost
engine while its main thread waits in a collective); against a TP=2 step of ~150 ms there
that is under 0.1%, so local ranks keep no pipe path of their own.

Every rank holds its share of the heads in the *same* block ids: the driver's block
manager decides for all, so ranks never coordinate memory.

NOTE: a rank that dies closes its sockets, so the driver's next collective fails at once
and the channel names the rank; one whose host vanishes goes quiet and is named after the
heartbeat timeout. A step that runs past ``hang_timeout`` seconds makes the driver tell
every rank to exit (their collectives then fail), naming the ranks that were inside it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.server.config import EngineConfig, ParallelConfig
from pagedllm.server.worker.channel_protocol import RankLostError, WorkerDiedError, join_timeout
from pagedllm.server.worker.leader_channel import LeaderChannel
from pagedllm.server.worker.process_group import init_group, layout
from pagedllm.server.worker.tp_rank import rank_process
from pagedllm.server.worker.worker import REPLIES

logger = logging.getLogger("pagedllm.tp")
HANG_TIMEOUT_ENV = "PAGEDLLM_TP_HANG_TIMEOUT"
REPLY_TIMEOUT_S = 600.0


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TPWorkers:
    """Starts (on this node), admits (from every node), drives, watches and stops ranks 1..N-1.

    To the executor they are the workers other than its own: :meth:`send` a message to all,
    then :meth:`collect` their answers (see :mod:`pagedllm.server.worker.worker`).
    """

    def __init__(self, config: EngineConfig, hf_config: dict, max_model_len: int, device_type: str) -> None:
        parallel = config.parallel
        self.size = parallel.tensor_parallel_size
        self.hang_timeout = float(os.environ.get(HANG_TIMEOUT_ENV, "60"))
        self.error: str | None = None
        self._step_started: float | None = None
        self._closed = False
        if parallel.nnodes == 1:  # NOTE: all ranks here: loopback, ports the OS picks
            bind, reach, port = "127.0.0.1", "127.0.0.1", 0
            init_method = f"tcp://127.0.0.1:{_free_port('127.0.0.1')}"
        else:
            bind, reach, port = "", parallel.master_addr, parallel.master_port
            init_method = f"tcp://{parallel.master_addr}:{parallel.master_port + 1}"
        self.channel = LeaderChannel(bind, port, {r: parallel.node_of(r) for r in range(1, self.size)})
        self.procs = _start_local_ranks(reach, self.channel.port, parallel)
        try:
            self.channel.accept_all(join_timeout(), lambda theirs: _layout_problem(parallel, theirs), self.check)
            self.channel.broadcast(("welcome", config, hf_config, max_model_len, init_method, device_type))
            self.channel.on_tick = self._watch
            self.channel.start()
            init_group(0, self.size, init_method, device_type)
        except Exception:
            self.shutdown()
            raise

    def wait_ready(self) -> None:
        """Wait until every rank has built its model shard; a failure there is re-raised here."""
        try:
            self.replies(join_timeout())
        except WorkerDiedError:
            self.shutdown()
            raise

    # -- messages ----------------------------------------------------------------------------
    def send(self, message: tuple) -> None:
        """One message to every rank (a step, a cache command, shutdown)."""
        self.check()
        self.channel.broadcast(message)
        self.check()

    def replies(self, timeout: float = REPLY_TIMEOUT_S) -> list[Any]:
        """One answer from every rank, in rank order; a rank that reported an error raises."""
        answers = []
        for rank in sorted(self.channel.peers):
            try:
                kind, value = self.channel.reply(rank, timeout)
            except RankLostError as exc:
                self.check()
                raise WorkerDiedError(str(exc)) from exc
            if kind == "error":
                raise WorkerDiedError(f"{self.channel.peers[rank].name()} failed: {value}")
            answers.append(value)
        return answers

    def collect(self, message: tuple) -> list[Any]:
        """The ranks' answers to ``message``, in rank order; none for a message that gets no reply."""
        return self.replies() if message[0] in REPLIES else []

    def step_started(self) -> None:
        self._step_started = time.monotonic()

    def step_ended(self) -> None:
        self._step_started = None

    # -- health -------------------------------------------------------------------------------
    def check(self, grace_s: float = 0.0) -> None:
        """Raise :class:`WorkerDiedError` naming the node and rank if a rank exited, went quiet or hung.

        ``grace_s``: how long to wait for such news (after a failed collective: a rank's sockets
        close while it exits, a moment before its exit and its lost connection can be seen).
        """
        deadline = time.monotonic() + grace_s
        while True:
            if self.error is None:
                self.error = self._local_exit() or self._channel_error()
            if self.error is not None:
                raise WorkerDiedError(self.error)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _local_exit(self) -> str | None:
        for rank, proc in self.procs.items():
            if not proc.is_alive():
                return f"tensor-parallel rank {rank} on node 0 (pid {proc.pid}) exited with code {proc.exitcode}"
        return None

    def _channel_error(self) -> str | None:
        lost = self.channel.lost_rank
        if lost in self.procs:  # NOTE: a local rank's exit code says more than its closed socket
            self.procs[lost].join(timeout=1)
            return self._local_exit() or self.channel.error
        return self.channel.error

    def _watch(self) -> None:
        """On the channel's thread: a step past ``hang_timeout`` stops every rank, naming the busy ones."""
        started = self._step_started
        if started is None or self.error is not None or time.monotonic() - started <= self.hang_timeout:
            return
        busy = ", ".join(f"rank {p.rank} on node {p.node}" for p in self.channel.busy_ranks()) or "unknown"
        self.error = f"a tensor-parallel step did not finish within {self.hang_timeout:.0f}s (still in it: {busy})"
        logger.error("%s; stopping every rank", self.error)
        self.channel.broadcast(("abort", self.error))  # NOTE: the driver's pending collective then fails
        for proc in self.procs.values():
            proc.kill()

    def shutdown(self) -> None:
        """Stop every rank (politely, then by force on this node) and leave the process group."""
        if self._closed:
            return
        self._closed = True
        self.channel.close(farewell=("shutdown",))
        for proc in self.procs.values():
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()


def _layout_problem(parallel: ParallelConfig, theirs: tuple[int, int]) -> str | None:
    if tuple(theirs) == layout(parallel):
        return None
    return (
        f"it was started with tensor_parallel_size={theirs[0]}, nnodes={theirs[1]}; node 0 has"
        f" tensor_parallel_size={parallel.tensor_parallel_size}, nnodes={parallel.nnodes}"
    )


def _start_local_ranks(host: str, port: int, parallel: ParallelConfig) -> dict[int, Any]:
    """Node 0's ranks other than 0, each a process that connects back to ``host:port``."""
    context = torch.multiprocessing.get_context("spawn")
    procs = {}
    for rank in parallel.ranks_of(0)[1:]:
        proc = context.Process(
            target=rank_process,
            args=(host, port, rank, 0, layout(parallel)),
            name=f"pagedllm-tp-rank{rank}",
            daemon=True,
        )
        proc.start()
        procs[rank] = proc
    return procs
