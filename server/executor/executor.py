"""The executor: one object between the engine and the N workers (tensor-parallel ranks) of a model.

::

    LLMEngine ──SchedulerOutput──► Executor ──┬─► LocalWorker (rank 0, this process) ──► ModelRunner
              ◄─StepOutputs─            └─► TPWorkers (ranks 1..N-1, their own processes, any node)
                                                        └── rank channel ──► tp_rank ──► ModelRunner

Every rank answers the same messages (:mod:`pagedllm.server.worker.worker`); rank 0 is a
worker like the others that happens to run in this process and to sample.

NOTE: this module imports no torch. The worker modules (and torch with them) are loaded when
the executor starts its workers, so the engine's modules import without torch.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pagedllm.server.config import EngineConfig, SpeculativeConfig
from pagedllm.server.worker.channel_protocol import WorkerDiedError
from pagedllm.server.worker.model_step import LaunchedStep, StepOutputs

if TYPE_CHECKING:
    from pagedllm.server.core.scheduler_output import SchedulerOutput
    from pagedllm.server.worker.draft_runner import DraftRunner
    from pagedllm.server.worker.model_runner import ModelRunner
    from pagedllm.server.worker.tp_workers import TPWorkers
    from pagedllm.server.worker.worker import LocalWorker

__all__ = ["Executor", "WorkerDiedError"]

STEP_FAILURE_GRACE_S = 2.0
"""After a failed tensor-parallel step, how long to wait for news of a rank that died in it."""


class Executor:
    """Starts, drives, watches and stops the workers of one model; the engine's only way to them."""

    def __init__(self, config: EngineConfig, hf_config: dict, max_model_len: int) -> None:
        from pagedllm.server.worker.model_runner import check_tensor_parallel, resolve_device
        from pagedllm.server.worker.models.tensor_parallel import TPGroup
        from pagedllm.server.worker.worker import LocalWorker, worker_class

        size = config.parallel.tensor_parallel_size
        device = resolve_device(config.model.device)
        check_tensor_parallel(hf_config, size, device, config.parallel.ranks_per_node)
        cls = worker_class(config.parallel.worker_cls)
        self.remote: TPWorkers | None = None
        """Ranks 1..N-1 (None with one rank)."""
        self._closed = False
        if size > 1:  # NOTE: the other ranks start first: they load their shards while this one does
            from pagedllm.server.worker.tp_workers import TPWorkers

            self.remote = TPWorkers(config, hf_config, max_model_len, device.type)
        try:
            self.local: LocalWorker = LocalWorker(cls(config, hf_config, max_model_len, TPGroup(0, size)))
            if self.remote is not None:
                self.remote.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.workers: list[Any] = [self.local] if self.remote is None else [self.local, self.remote]
        """Every worker, rank 0 first; each gets every message (:meth:`_all`)."""
        self._stepper: ThreadPoolExecutor | None = None
        """The one thread that runs steps handed over by :meth:`submit` on a CPU (made on first use)."""
        self.queues_on_device = device.type == "cuda"
        """:meth:`submit` queues the step on the device in the caller's thread (no step thread)."""

    @staticmethod
    def device_type(name: str) -> str:
        """The device type ``--device`` ``name`` resolves to here (``auto``: CUDA if there is one)."""
        from pagedllm.server.worker.model_runner import resolve_device

        return resolve_device(name).type

    @property
    def driver(self) -> ModelRunner:
        """Rank 0's runner, in this process (it samples; tests and benchmarks read it)."""
        return self.local.runner

    def _all(self, message: tuple) -> list[Any]:
        """``message`` to every worker, rank 0's run last so the others start at once; the answers, rank 0 first."""
        for worker in reversed(self.workers):
            worker.send(message)
        return [answer for worker in self.workers for answer in worker.collect(message)]

    def _on_rank0(self, message: tuple) -> Any:
        """``message`` to rank 0 alone (the others got theirs already); its answer."""
        self.local.send(message)
        return self.local.collect(message)[0]

    # -- KV cache --------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """Bytes of one block on a rank, across its layers, K and V."""
        return self.driver.block_bytes

    def num_device_blocks(self, useful_blocks: int) -> int:
        """Device blocks every rank can hold: each rank's count, the smallest agreed."""
        return min(self._all(("device_blocks", useful_blocks)))

    def num_host_blocks(self, useful_blocks: int) -> int:
        return min(self._all(("host_blocks", useful_blocks)))

    def allocate_cache(self, num_device_blocks: int, num_host_blocks: int) -> None:
        """Allocate the same number of blocks on every rank (each for its own heads)."""
        self._all(("allocate", num_device_blocks, num_host_blocks))

    # -- steps -----------------------------------------------------------------------------------
    def execute(self, step: SchedulerOutput) -> StepOutputs:
        """Run one step on every rank; rank 0's outputs (tokens, pooled sums). Only rank 0 gets the sampling.

        NOTE: every rank gets the same id-keyed output and applies the same diffs to its own
        persistent batch, so the ranks' batches stay the same.
        """
        if self.remote is None:
            return self._on_rank0(("step", step))
        self.remote.send(("step", step.for_other_ranks()))
        self.remote.step_started()
        try:
            return self._on_rank0(("step", step))
        except Exception as exc:
            self.remote.check(grace_s=STEP_FAILURE_GRACE_S)  # NOTE: a dead or hung rank is the likely cause: name it
            raise RuntimeError(f"the tensor-parallel step failed: {exc!r}") from exc
        finally:
            self.remote.step_ended()

    def submit(self, step: SchedulerOutput) -> Future[LaunchedStep]:
        """Start one step and return at once (``async_scheduling``): its outputs come in the future,
        as a :class:`LaunchedStep` whose ``outputs()`` waits for the sampled tokens.

        On a GPU the step is queued here, in the caller's thread: its kernels and the copy of its
        tokens to the host go on the stream behind the step before, and nothing waits for the
        device. On a CPU, where running a step is computing it, one thread runs the submitted
        steps in order while the caller goes on. Either way a step scheduled ahead finds the
        tokens of the step before on the device. One rank only (the engine config refuses
        ``async_scheduling`` with more).
        """
        assert self.remote is None, "steps are submitted on one rank only"
        if self.queues_on_device:
            done: Future[LaunchedStep] = Future()
            try:
                done.set_result(self._on_rank0(("launch", step)))
            except Exception as exc:
                done.set_exception(exc)
            return done
        if self._stepper is None:
            self._stepper = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-step")
        return self._stepper.submit(self._on_rank0, ("launch", step))

    def start_draft(self, spec: SpeculativeConfig, target_vocab: int, max_model_len: int) -> DraftRunner:
        """The draft model of ``draft_model`` speculation, on rank 0's device, in the target's dtype."""
        from pagedllm.server.worker.draft_runner import DraftRunner

        return DraftRunner(self.driver.config, spec, target_vocab, max_model_len, self.driver.dtype)

    # -- health and lifecycle --------------------------------------------------------------------
    def check_health(self) -> None:
        """Raise :class:`WorkerDiedError` if a tensor-parallel rank is gone."""
        if self.remote is not None:
            self.remote.check()

    def shutdown(self) -> None:
        """Free rank 0's KV cache, stop the other ranks and leave the process group (idempotent).

        NOTE: the other ranks free their caches as their processes exit; the process group is
        left last, so a new tensor-parallel executor can start in this process.
        """
        if self._closed:
            return
        self._closed = True
        stepper = getattr(self, "_stepper", None)
        if stepper is not None:
            stepper.shutdown(wait=True)  # NOTE: a step in flight ends before the cache it writes is freed
        local = getattr(self, "local", None)
        if local is not None:
            local.shutdown()
        if self.remote is not None:
            self.remote.shutdown()
