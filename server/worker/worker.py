"""What one rank does with the executor's messages, wherever it runs.

Every rank, the executor's own (rank 0, in its process) and the others (their own processes,
on this node or another), is a :class:`~pagedllm.server.worker.model_runner.ModelRunner`
(or the class ``ParallelConfig.worker_cls`` names) that answers the same messages::

    ("device_blocks", useful)  -> how many device blocks fit here      (answered)
    ("host_blocks", useful)    -> how many host blocks fit here        (answered)
    ("allocate", device, host) -> allocate this rank's KV cache
    ("step", SchedulerOutput)  -> apply its diffs to this rank's batch, run the step; rank 0 samples
                                  and returns its StepOutputs
    ("launch", SchedulerOutput) -> the same without waiting for the sampled tokens (rank 0 alone,
                                  ``async_scheduling``): a LaunchedStep, whose outputs() waits

The executor sends each message to all of its workers and collects their answers; for the
other ranks the message travels over the rank channel (:mod:`pagedllm.server.worker.tp_rank`).
"""

from __future__ import annotations

import importlib
from typing import Any

from pagedllm.server.config import ConfigError
from pagedllm.server.worker.model_runner import ModelRunner

REPLIES = frozenset({"device_blocks", "host_blocks"})
"""The messages every rank answers (the others get no reply)."""


def handle(runner: ModelRunner, message: tuple) -> Any:
    """Run one executor message on this rank's runner; its answer."""
    kind, *args = message
    if kind == "device_blocks":
        return runner.device_blocks(*args)
    if kind == "host_blocks":
        return runner.host_blocks(*args)
    if kind == "allocate":
        return runner.allocate_cache(*args)
    if kind == "step":
        return runner.execute(*args)
    if kind == "launch":
        return runner.launch(*args)
    raise ValueError(f"unknown worker message {kind!r}")


def worker_class(name: str) -> type[ModelRunner]:
    """The class every rank runs: the model runner (``auto``), or one named ``module:Class``."""
    if name == "auto":
        return ModelRunner
    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("worker_cls", name, "auto or an importable module:Class") from exc
    if not (isinstance(cls, type) and issubclass(cls, ModelRunner)):
        raise ConfigError("worker_cls", name, "a subclass of ModelRunner")
    return cls


class LocalWorker:
    """The executor's own rank: a worker like the others, whose messages run in this process.

    :meth:`send` only keeps the message; :meth:`collect` runs it, so the executor sends to the
    other ranks first and they work while this one does.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._message: tuple | None = None

    def send(self, message: tuple) -> None:
        self._message = message

    def collect(self, message: tuple) -> list[Any]:
        assert self._message is message, "collect() answers the message just sent"
        self._message = None
        return [handle(self.runner, message)]

    def check(self) -> None:
        """The rank in this process is alive while the process is."""

    def shutdown(self) -> None:
        self.runner.shutdown()
