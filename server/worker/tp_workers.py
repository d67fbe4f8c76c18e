"""Tensor-parallel ranks 1..N-1, each in a process of its own, driven by rank 0 in this process.

::

    engine process (rank 0, the driver)             worker process (rank r)
    ───────────────────────────────────             ───────────────────────
    scheduler, block manager, sampler               ModelRunner with TPGroup(r, N)
    ModelRunner with TPGroup(0, N) ──pipe──► one message per step: ("step", ModelStep)
            │  all-reduce / gather inside the model (gloo on CPU, NCCL on CUDA)  │
            └───────────────────────────────────────────────────────────────────┘

Every rank holds its share of the heads in the *same* block ids: the driver's block
manager decides for all, so workers never coordinate memory. Control messages go over
pipes (an idle worker waits on its pipe, which has no timeout); only the model's
collectives go through torch.distributed.

NOTE: a worker that dies closes its sockets, so the driver's next collective fails at
once; :meth:`TPWorkers.check` then names the rank. A worker that hangs is killed by the
watchdog after ``hang_timeout`` seconds in one step, which fails the collective too.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing.connection
import os
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.server.config import EngineConfig

logger = logging.getLogger("pagedllm.tp")
START_TIMEOUT_S = 600.0
HANG_TIMEOUT_ENV = "PAGEDLLM_TP_HANG_TIMEOUT"


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank exited or hung: the model can no longer run (fatal for the engine)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world_size: int, init_method: str, device_type: str) -> None:
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=float(os.environ.get("PAGEDLLM_TP_COLLECTIVE_TIMEOUT", "300")))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)


class TPWorkers:
    """Starts, drives, watches and stops ranks 1..N-1."""

    def __init__(self, config: EngineConfig, hf_config: dict, max_model_len: int, device_type: str) -> None:
        size = config.parallel.tensor_parallel_size
        self.size = size
        self.hang_timeout = float(os.environ.get(HANG_TIMEOUT_ENV, "60"))
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = torch.multiprocessing.get_context("spawn")
        self.pipes: list[multiprocessing.connection.Connection] = []
        self.procs: list[Any] = []
        for rank in range(1, size):
            parent, child = context.Pipe()
            proc = context.Process(
                target=worker_main,
                args=(child, config, hf_config, max_model_len, rank, size, init_method, device_type),
                name=f"pagedllm-tp-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.pipes.append(parent)
            self.procs.append(proc)
        self.error: str | None = None
        self._step_started: float | None = None
        self._closed = False
        try:
            init_group(0, size, init_method, device_type)
        except Exception:
            self.shutdown()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="pagedllm-tp-watchdog", daemon=True)
        self._watchdog.start()

    def wait_ready(self) -> None:
        """Wait until every worker has built its model shard; a failure there is re-raised here."""
        for rank, reply in enumerate(self.replies(START_TIMEOUT_S), start=1):
            if reply[0] == "error":
                self.shutdown()
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {reply[1]}")

    # -- messages ----------------------------------------------------------------------------
    def send(self, message: tuple) -> None:
        """One message to every worker (a step, a cache command, shutdown)."""
        self.check()
        try:
            for pipe in self.pipes:
                pipe.send(message)
        except (BrokenPipeError, EOFError, OSError) as exc:
            self.check()
            raise WorkerDiedError(f"a tensor-parallel worker stopped listening: {exc!r}") from exc

    def replies(self, timeout: float = 120.0) -> list[Any]:
        """One reply from every worker, in rank order."""
        answers = []
        for rank, pipe in enumerate(self.pipes, start=1):
            deadline = time.monotonic() + timeout
            while not pipe.poll(0.1):
                self.check()
                if time.monotonic() > deadline:
                    raise WorkerDiedError(f"tensor-parallel rank {rank} did not answer within {timeout:.0f}s")
            try:
                answers.append(pipe.recv())
            except EOFError as exc:
                self.check()
                raise WorkerDiedError(f"tensor-parallel rank {rank} closed its pipe") from exc
        return answers

    def step_started(self) -> None:
        self._step_started = time.monotonic()

    def step_ended(self) -> None:
        self._step_started = None

    # -- health -------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`WorkerDiedError` naming the rank if a worker exited or hung."""
        if self.error is None:
            for rank, proc in enumerate(self.procs, start=1):
                if not proc.is_alive():
                    self.error = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
                    break
        if self.error is not None:
            raise WorkerDiedError(self.error)

    def _watch(self) -> None:
        while not self._closed:
            started = self._step_started
            if started is not None and time.monotonic() - started > self.hang_timeout and self.error is None:
                self.error = f"a tensor-parallel step did not finish within {self.hang_timeout:.0f}s: ranks hung"
                logger.error("%s; stopping the workers", self.error)
                for proc in self.procs:
                    proc.kill()  # NOTE: the driver's pending collective then fails instead of waiting
            time.sleep(0.2)

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force) and leave the process group."""
        if self._closed:
            return
        self._closed = True
        for pipe in self.pipes:
            try:
                pipe.send(("shutdown",))
            except (BrokenPipeError, EOFError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for pipe in self.pipes:
            pipe.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_main(
    conn: multiprocessing.connection.Connection,
    config: EngineConfig,
    hf_config: dict,
    max_model_len: int,
    rank: int,
    size: int,
    init_method: str,
    device_type: str,
) -> None:
    """A worker process: build this rank's shard, then run what the driver sends until told to stop."""
    from pagedllm.server.worker.model_runner import ModelRunner
    from pagedllm.server.worker.models.tensor_parallel import TPGroup

    try:
        init_group(rank, size, init_method, device_type)
        runner = ModelRunner(config, hf_config, max_model_len, TPGroup(rank, size))
        conn.send(("ready", None))
    except BaseException as exc:  # noqa: BLE001 (reported to the driver)
        conn.send(("error", repr(exc)))
        return
    try:
        _serve(conn, runner)
    except Exception:
        logger.exception("tensor-parallel rank %d failed; exiting", rank)
        os._exit(1)  # NOTE: closes this rank's sockets, so the driver's collective fails at once
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(conn: multiprocessing.connection.Connection, runner: Any) -> None:
    from pagedllm.server.worker.step_inputs import ModelStep

    while True:
        try:
            kind, *args = conn.recv()
        except EOFError:
            return  # the driver is gone
        if kind == "shutdown":
            return
        if kind == "device_blocks":
            conn.send(runner.local_device_blocks(*args))
        elif kind == "host_blocks":
            conn.send(runner.local_host_blocks(*args))
        elif kind == "allocate":
            runner.allocate_local_cache(*args)
        elif kind == "step":
            runner.run_step(ModelStep.from_wire(args[0]))
        elif kind == "inject_fault":  # tests: die or hang on the next step
            runner.fault = args[0]
