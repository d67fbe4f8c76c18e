"""A tensor-parallel rank other than 0: join the driver, build this rank's shard, run what it sends.

One process per rank. On node 0 the engine starts them (:mod:`pagedllm.server.worker.tp_workers`);
on any other node ``pagedllm serve --headless`` runs :func:`run_node`, which runs the node's
first rank in its own process and starts the others beside it.

The driver's welcome carries its engine config, the model's Hugging Face config and the
model length, so every rank builds the same model the same way; each node needs only the
model files at the same path.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.server.config import ParallelConfig
from pagedllm.server.worker.channel_protocol import RankLostError, join_timeout
from pagedllm.server.worker.model_runner import ModelRunner
from pagedllm.server.worker.models.tensor_parallel import TPGroup
from pagedllm.server.worker.process_group import init_group, layout
from pagedllm.server.worker.rank_channel import RankChannel
from pagedllm.server.worker.worker import REPLIES, handle, worker_class

logger = logging.getLogger("pagedllm.tp")


def rank_process(host: str, port: int, rank: int, node: int, agreed: tuple[int, int]) -> None:
    """Entry point of a spawned rank process."""
    sys.exit(run_rank(host, port, rank, node, agreed))


def run_node(parallel: ParallelConfig) -> int:
    """Run this node's ranks until the driver says stop; the worst exit code of them.

    NOTE: the first rank runs in this process, so killing it (the pod's main process) closes
    its connection and the driver notices at once; the driver's exit then ends the others.
    """
    ranks = parallel.ranks_of(parallel.node_rank)
    context = torch.multiprocessing.get_context("spawn")
    host, port, agreed = parallel.master_addr, parallel.master_port, layout(parallel)
    procs = [
        context.Process(
            target=rank_process, args=(host, port, rank, parallel.node_rank, agreed), name=f"pagedllm-tp-rank{rank}"
        )
        for rank in ranks[1:]
    ]
    for proc in procs:
        proc.start()
    threading.Thread(target=_watch_siblings, args=(procs,), name="pagedllm-tp-siblings", daemon=True).start()
    code = run_rank(host, port, ranks[0], parallel.node_rank, agreed)
    for proc in procs:
        proc.join(timeout=30 if code == 0 else 0)  # NOTE: after a failure the group is over: no waiting
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    return max([code, *(abs(proc.exitcode or 0) for proc in procs)])


def _watch_siblings(procs: list[Any]) -> None:
    """End this node at once when one of its other ranks fails (the group cannot run without it)."""
    while True:
        for proc in procs:
            if proc.exitcode not in (None, 0):
                logger.error("%s (pid %d) exited with code %s: this node exits", proc.name, proc.pid, proc.exitcode)
                for other in procs:
                    other.kill()
                os._exit(1)
        if all(proc.exitcode == 0 for proc in procs):
            return
        time.sleep(0.2)


def run_rank(host: str, port: int, rank: int, node: int, agreed: tuple[int, int]) -> int:
    """Join the driver at ``host:port`` as ``rank`` of ``node``, serve its steps; the exit code."""
    hello = ("hello", rank, node, os.getpid(), socket.gethostname(), agreed)
    try:
        channel = RankChannel.connect(host, port, hello, join_timeout())
        welcome = channel.first(join_timeout())
    except (RankLostError, OSError) as exc:
        logger.error(
            "tensor-parallel rank %d on node %d could not join the leader at %s:%d: %s", rank, node, host, port, exc
        )
        return 1
    if welcome[0] == "refused":
        logger.error("the leader at %s:%d refused rank %d on node %d: %s", host, port, rank, node, welcome[1])
        return 2
    _, config, hf_config, max_model_len, init_method, device_type = welcome
    channel.start()
    runner = _build(channel, config, hf_config, max_model_len, rank, init_method, device_type)
    if runner is None:
        return 1
    try:
        _serve(channel, runner)
    except Exception:
        logger.exception("tensor-parallel rank %d on node %d failed; exiting", rank, node)
        os._exit(1)  # NOTE: closes this rank's sockets, so the driver's collective fails at once
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    channel.close()
    return 0


def _build(
    channel: RankChannel,
    config: Any,
    hf_config: dict,
    max_model_len: int,
    rank: int,
    init_method: str,
    device_type: str,
) -> ModelRunner | None:
    size = config.parallel.tensor_parallel_size
    try:
        init_group(rank, size, init_method, device_type)
        runner = worker_class(config.parallel.worker_cls)(config, hf_config, max_model_len, TPGroup(rank, size))
    except BaseException as exc:  # noqa: BLE001 (reported to the driver)
        channel.send(("error", repr(exc)))
        return None
    channel.send(("ready", None))
    return runner


def _serve(channel: RankChannel, runner: ModelRunner) -> None:
    """Answer the executor's messages (:mod:`pagedllm.server.worker.worker`) until it says stop."""
    while True:
        message = channel.recv()
        if message[0] == "shutdown":
            return
        channel.busy = message[0] == "step"
        answer = handle(runner, message)
        channel.busy = False
        if message[0] in REPLIES:
            channel.send(("reply", answer))
