"""The executor: the one object the engine drives its workers through (:class:`Executor`)."""

from pagedllm.server.executor.executor import Executor, WorkerDiedError

__all__ = ["Executor", "WorkerDiedError"]
