"""The engine loop: requests in, one scheduled model step at a time, outputs back.

::

    add_request ─► InputProcessor (encode, validate) ─► Scheduler.waiting
    step():  Scheduler.schedule() ─► StepBuilder.build() + SamplingRows.build() ─► Executor.execute(SchedulerOutput)
             (every rank's worker runs the model, rank 0 samples on its device: tokens back) ─►
             StepResults, BeamSearch, SpecDecoder, OutputProcessor decide (tokens, text, stop checks,
             forks) ─► Scheduler.update_from_output applies ─► [RequestOutput | EmbeddingRequestOutput]

The engine sends steps as ids, counts and diffs (no arrays, no torch); every worker keeps the
batch and builds the arrays. The executor starts the workers, which load torch and the model
(:mod:`pagedllm.server.executor`).

Embedding requests (``PoolingParams``) are scheduled with the others and prefilled the
same way, in chunks; the step that computes the end of the prompt pools it, the request
finishes, and its blocks are freed after that step.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from pagedllm.server.config import ConfigError, EngineConfig, choose_token_budget
from pagedllm.server.core.block_manager import BlockManager
from pagedllm.server.core.kv_reservation import KVReservation
from pagedllm.server.core.lora_slots import LoRASlots
from pagedllm.server.core.scheduler import ScheduledStep, Scheduler
from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.engine.beam_search import BeamSearch, BeamState
from pagedllm.server.engine.engine_stats import EngineStats
from pagedllm.server.engine.faults import EngineFatalError, StepFailureWindow
from pagedllm.server.engine.input_processor import InputProcessor, PromptType
from pagedllm.server.engine.lora_registry import LoRARegistry
from pagedllm.server.engine.model_info import ModelInfo, load_tokenizer, read_model_info
from pagedllm.server.engine.output_processor import OutputProcessor
from pagedllm.server.engine.sampling_rows import SamplingRows
from pagedllm.server.engine.spec_decode.draft_model import DraftModel
from pagedllm.server.engine.spec_decode.spec_decoder import SpecDecoder
from pagedllm.server.engine.step_inputs import StepBuilder, StepResult
from pagedllm.server.engine.step_results import RequestState, StepResults
from pagedllm.server.engine.structured_output import StructuredOutputs
from pagedllm.server.engine.warm_up import warm_up
from pagedllm.server.executor import Executor, WorkerDiedError
from pagedllm.server.hf_config import read_hf_config
from pagedllm.server.lora_request import LoRARequest
from pagedllm.server.outputs import EngineOutput
from pagedllm.server.pooling_params import PoolingParams
from pagedllm.server.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.server.engine.kv_event_publisher import ZmqEventPublisher
    from pagedllm.server.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm.engine")


class EngineClosedError(RuntimeError):
    """The engine was shut down: its ranks are stopped and its KV cache is freed."""


class LLMEngine:
    """Owns the scheduler, block manager and the executor of one model's workers.

    ``shutdown()`` (or leaving a ``with LLMEngine(config) as engine:`` block) stops the
    tensor-parallel ranks, leaves the process group and frees the KV cache at once; an
    engine that is dropped does the same as soon as its last reference goes.
    """

    def __init__(self, config: EngineConfig) -> None:
        config = _with_model_dir(config)
        self.config = config
        assert config.model.model is not None
        hf_config = read_hf_config(config.model.model)
        self.tokenizer = (
            None if config.model.skip_tokenizer_init else load_tokenizer(config.model.tokenizer or config.model.model)
        )
        info = read_model_info(config, hf_config, self.tokenizer)
        device_type = Executor.device_type(config.model.device)
        config = _with_token_budget(config, device_type, info.max_model_len)
        config = self.config = dataclasses.replace(config, cache=config.cache.with_block_size(device_type))
        self._check_scheduler_fits(info.max_model_len)
        self.executor = Executor(config, hf_config, info.max_model_len)
        self.draft: DraftModel | None = None
        """The draft model of ``draft_model`` speculation (None otherwise)."""
        self.kv_event_publisher: ZmqEventPublisher | None = None
        """Sends the prefix cache's events (``--kv-events-config``); None when they are off."""
        # NOTE: runs shutdown() when the last reference to the engine goes or the interpreter exits.
        # Nothing the engine owns may point back at it (no bound methods of it handed to its
        # parts), or the engine sits in a cycle and its ranks and process group outlive it
        # until a garbage-collection pass: a second tensor-parallel engine could not start.
        self._closers: list[Callable[[], None]] = [self.executor.shutdown]
        self._finalizer = weakref.finalize(self, _close_all, self._closers)
        try:
            spec = config.scheduler.speculative_config
            if spec is not None and spec.method == "draft_model":
                self.draft = self.executor.start_draft(spec, info.vocab_size, info.max_model_len)
                self._closers.append(self.draft.shutdown)
            self._build(config, info)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig, info: ModelInfo) -> None:
        self.kv_event_publisher = _open_kv_event_publisher(config)
        if self.kv_event_publisher is not None:
            self._closers.insert(0, self.kv_event_publisher.close)
        self.block_manager = self._allocate_cache(info.max_model_len, info.kv_window)
        # NOTE: a single sequence must always fit in the cache on its own, else it could never finish.
        bm = self.block_manager
        capacity = (bm.gpu.num_blocks - bm.watermark_blocks) * bm.block_size
        self.model_info: ModelInfo = dataclasses.replace(info, max_model_len=min(info.max_model_len, capacity))
        limit = self.model_info.max_model_len
        self.lora_slots = LoRASlots(config.lora.max_loras) if config.lora.enable_lora else None
        self.loras = LoRARegistry(self.runner.lora, self.lora_slots)
        """Adapters checked against the model, by id."""
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.lora_slots)
        self.step_builder = StepBuilder(self.scheduler.worker_view)
        self.input_processor = InputProcessor(self.tokenizer, info.vocab_size, limit, config.scheduler.max_num_seqs)
        self.output_processor = OutputProcessor(self.tokenizer, info.eos_token_ids, limit)
        self.request_output: Callable[[SequenceGroup], Any] = OutputProcessor.request_output
        """What :meth:`step` reports for a generation request; the engine-core process reports deltas instead."""
        self._next_seq_id = itertools.count().__next__  # NOTE: the counter's method, not the engine's
        self._requests: dict[str, RequestState] = {}
        self._num_steps = 0
        self.step_failures = StepFailureWindow()
        beam_search = BeamSearch(self.output_processor, self._next_seq_id)
        self.spec_decoder = self._spec_decoder(config)
        structured = StructuredOutputs(self.tokenizer, info.vocab_size, info.eos_token_ids)
        self.sampling_rows = SamplingRows(self._requests, structured, info.eos_token_ids)
        """Describes each step's rows for the worker's sampler."""
        self.step_results = StepResults(
            self.output_processor,
            beam_search,
            self._requests,
            self._next_seq_id,
            structured,
            self.spec_decoder,
        )

    def _spec_decoder(self, config: EngineConfig) -> SpecDecoder | None:
        spec = config.scheduler.speculative_config
        if spec is None:
            return None
        if config.cache.kv_reservation != "paged":
            raise ConfigError(
                "speculative_config",
                spec,
                "use kv_reservation='paged' with speculative decoding",
                problem=f"is not supported with kv_reservation={config.cache.kv_reservation!r}",
                subject="{name}",
            )
        return SpecDecoder(spec, self.output_processor, self.block_manager, self._requests, self.draft)

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's worker, in this process (its model, cache and sampler; tests and benchmarks read it)."""
        return self.executor.driver

    @property
    def max_model_len(self) -> int:
        return self.model_info.max_model_len

    def _check_scheduler_fits(self, max_model_len: int) -> None:
        sched = self.config.scheduler
        if not sched.enable_chunked_prefill and sched.token_budget < max_model_len:
            raise ConfigError(
                "max_num_batched_tokens",
                sched.token_budget,
                "raise it, leave it unset, or enable chunked prefill",
                problem=f"is smaller than max_model_len={max_model_len}",
            )

    def _allocate_cache(self, max_model_len: int, kv_window: int | None) -> BlockManager:
        config = self.config
        useful = config.scheduler.max_num_seqs * -(-max_model_len // config.cache.tokens_per_block)
        executor = self.executor
        num_cpu_blocks = executor.num_host_blocks(useful)
        if self.draft is None or config.cache.num_gpu_blocks_override is not None:
            num_gpu_blocks = executor.num_device_blocks(useful)
        else:  # NOTE: the draft's cache takes its share of the same memory, block for block
            target, both = executor.block_bytes, executor.block_bytes + self.draft.block_bytes
            num_gpu_blocks = max(1, executor.num_device_blocks(-(-useful * both // target)) * target // both)
        executor.allocate_cache(num_gpu_blocks, num_cpu_blocks)
        if self.draft is not None:
            self.draft.allocate(num_gpu_blocks)
        bm = BlockManager(
            config.cache.tokens_per_block,
            num_gpu_blocks,
            num_cpu_blocks,
            config.cache.enable_prefix_caching,
            sliding_window=kv_window,
            kv_events=self.kv_event_publisher is not None,
        )
        if config.cache.kv_reservation != "paged":
            # NOTE: no reservation exceeds what the cache can hold, or Orca (Max) could admit nothing.
            capacity = (bm.gpu.num_blocks - bm.watermark_blocks) * bm.block_size
            bm.reservation = KVReservation(config.cache.kv_reservation, bm.block_size, min(max_model_len, capacity))
        return bm

    # -- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a generation (``SamplingParams``) or an embedding (``PoolingParams``) request,
        run with the LoRA adapter ``lora_request`` if given.

        An invalid prompt or parameters, or an adapter that does not fit the model, raise
        :class:`ConfigError` at once.
        """
        self._check_open()
        if request_id in self._requests:
            raise ConfigError("request_id", request_id, "give each request its own id", problem="is already in use")
        processed = self.input_processor.process(prompt, params)
        self.add_lora(lora_request)
        lora_id = lora_request.lora_int_id if lora_request is not None else 0
        seq = Sequence(self._next_seq_id(), processed.token_ids, cache_salt=processed.cache_salt, lora_int_id=lora_id)
        pooling = self._pooling_params(params)
        # NOTE: an embedding request carries plain one-sequence sampling parameters, so the
        # scheduler treats it as any prompt; it never samples (see StepResults._pool).
        sampling = params if isinstance(params, SamplingParams) else SamplingParams(max_tokens=1)
        self._expect_length(seq, sampling, pooling)
        group = SequenceGroup(
            request_id,
            [seq],
            sampling,
            prompt=processed.text,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            pooling_params=pooling,
            lora_request=lora_request,
        )
        guided = sampling.guided_decoding
        grammar = self.step_results.structured.compile(guided) if guided is not None else None
        beam = BeamState() if sampling.use_beam_search else None
        self._requests[request_id] = RequestState(group, beam, grammar)
        self.scheduler.add(group)

    def add_lora(self, lora_request: LoRARequest | None) -> None:
        """Check an adapter against the model once per id (see :meth:`LoRARegistry.add`)."""
        self.loras.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False (nothing done) while requests use it."""
        return self.loras.remove(lora_int_id)

    def _pooling_params(self, params: SamplingParams | PoolingParams) -> PoolingParams | None:
        """An embedding request's parameters with the engine's pooling type filled in; None for generation."""
        if not isinstance(params, PoolingParams):
            return None
        if params.pooling_type is not None:
            return params
        return dataclasses.replace(params, pooling_type=self.model_info.pooling_type)

    def _expect_length(self, seq: Sequence, params: SamplingParams, pooling: PoolingParams | None) -> None:
        """Tell a reservation-based allocator (benchmarks) how long the request can grow."""
        reservation = self.block_manager.reservation
        if reservation is None:
            return
        if pooling is not None:
            reservation.expect(seq.seq_id, len(seq))
            return
        if params.best_of > 1:
            raise ConfigError(
                "best_of",
                params.best_of,
                "use kv_reservation='paged' for parallel sampling and beam search",
                problem=f"is not supported with kv_reservation={reservation.mode!r}",
            )
        reservation.expect(seq.seq_id, len(seq) + (params.max_tokens or self.max_model_len))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop the request(s) wherever they are; their blocks are freed at once. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for group in self.scheduler.abort(ids):
            self._forget(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step -----------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Run one iteration; return the outputs of every request it advanced.

        NOTE: a failure in one request's work (sampling, stop checks, text, logprobs, beam
        bookkeeping) fails that request alone; a failed model step fails the step's
        requests. Either way their blocks are freed and the engine goes on, unless the
        bookkeeping no longer adds up or steps keep failing (:class:`EngineFatalError`).
        """
        self._check_open()
        if self.spec_decoder is not None:
            self.scheduler.set_proposals(self.spec_decoder.propose(self.scheduler.running, self.max_model_len))
        out = self.scheduler.schedule()
        touched = {id(g): g for g in out.ignored}
        failed: dict[str, str] = {}
        updates = None
        if not out.is_empty:
            self._num_steps += 1
            touched.update((id(item.group), item.group) for item in out.scheduled)
            try:
                if self.spec_decoder is not None:
                    # NOTE: a failing draft fails the step, as the model would
                    self.scheduler.set_proposals(self.spec_decoder.fill_drafts(out))
                inputs, plan = self.step_builder.build(out)
                plan = plan.with_sampling(self.sampling_rows.build(inputs, failed))
                result = StepResult.of(inputs, self.executor.execute(plan))
            except WorkerDiedError as exc:
                raise EngineFatalError(str(exc)) from exc
            except Exception as exc:
                self._model_step_failed(out, exc, failed, touched)
            else:
                updates = self.step_results.decide(result, failed)
        self.scheduler.update_from_output(out, updates, failed)  # NOTE: the one place sequences change
        if failed:
            self._check_invariants()
        self._publish_kv_events()
        outputs = []
        for group in touched.values():
            output = self._output(group)
            output.error = failed.get(group.request_id)
            if output.finished:
                self._forget(group)
            outputs.append(output)
        return outputs

    def _forget(self, group: SequenceGroup) -> None:
        """Drop a request that ended: its state here, and (next step) its generator on the worker."""
        if self._requests.pop(group.request_id, None) is not None:
            self.sampling_rows.finished(group.request_id, group.sampling_params)

    def _output(self, group: SequenceGroup) -> EngineOutput:
        if group.pooling_params is None:
            return self.request_output(group)
        state = self._requests.get(group.request_id)
        return self.output_processor.embedding_output(group, state.embedding if state is not None else None)

    def _publish_kv_events(self) -> None:
        """Hand what entered and left the prefix cache since the last call to the publisher, as one batch."""
        if self.kv_event_publisher is None:
            return
        events = self.block_manager.take_kv_events()
        if events:
            self.kv_event_publisher.publish(events)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block, as vLLM's; refused (False) while requests hold blocks.

        With KV events on, subscribers get ``AllBlocksCleared``.
        """
        self._check_open()
        done = self.block_manager.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def _model_step_failed(
        self, out: ScheduledStep, error: Exception, failed: dict[str, str], touched: dict[int, SequenceGroup]
    ) -> None:
        logger.error("model step %d failed: %r", self._num_steps, error, exc_info=error)
        self.scheduler.worker_view.forget_all()  # NOTE: what the workers applied of the step is unknown
        for item in out.scheduled:
            failed[item.group.request_id] = f"the model step failed: {error!r}"
        # NOTE: groups swapped out for this step may hold host blocks that were never filled.
        for group in out.preempted:
            if any(seq.status == SequenceStatus.SWAPPED for seq in group.seqs):
                failed[group.request_id] = f"the model step that swapped it out failed: {error!r}"
                touched[id(group)] = group
        self.step_failures.record(error)

    def _check_invariants(self) -> None:
        problems = self.block_manager.check_invariants()
        if problems:
            raise EngineFatalError("the KV block bookkeeping is broken: " + "; ".join(problems[:3]))

    def check_health(self) -> None:
        """Raise :class:`EngineFatalError` if the engine can no longer run (a tensor-parallel rank died)."""
        try:
            self.executor.check_health()
        except WorkerDiedError as exc:
            raise EngineFatalError(str(exc)) from exc

    # -- lifecycle -----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, leave the process group, free the KV cache.

        Idempotent; also runs when the engine is dropped and at interpreter exit. Afterwards
        :meth:`add_request` and :meth:`step` raise :class:`EngineClosedError`.
        """
        self._finalizer()

    @property
    def is_closed(self) -> bool:
        """True once :meth:`shutdown` has run."""
        return not self._finalizer.alive

    def _check_open(self) -> None:
        if self.is_closed:
            raise EngineClosedError(
                "the engine was shut down (shutdown() or the end of its `with` block): build a new one"
            )

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def describe(self, host: str | None = None, port: int | None = None) -> str:
        """The start-up summary a person reads: what runs where, and how much cache it has."""
        runner, bm, config = self.runner, self.block_manager, self.config
        lines = [
            f"model            {config.model.model}" + (f" ({runner.quant_info})" if runner.quant_info else ""),
            f"dtype / device   {str(runner.dtype).removeprefix('torch.')} on {runner.device}"
            f" x {config.parallel.tensor_parallel_size} rank(s), {runner.threads.threads} CPU thread(s)",
            f"attention        {runner.ops.name}",
            f"KV cache blocks  {bm.gpu.num_blocks} device + {bm.cpu.num_blocks} host,"
            f" {config.cache.tokens_per_block} tokens each of {str(runner.cache_dtype).removeprefix('torch.')}",
            f"max model len    {self.max_model_len} tokens, max {config.scheduler.max_num_seqs} sequences"
            f" and {config.scheduler.token_budget} tokens per step",
        ]
        if self.spec_decoder is not None:
            lines.append(f"speculative      {self.spec_decoder.describe()}")
        if host is not None:
            lines.append(f"serving          http://{host}:{port}/v1 (docs at /docs)")
        return "ready\n  " + "\n  ".join(lines)

    def warm_up(self, max_steps: int = 100) -> None:
        """Run one real request, so a caller knows the model has run (:func:`warm_up`)."""
        warm_up(self, max_steps)

    # -- state ----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        sharing = bm.sharing_stats()
        return EngineStats(
            num_running=sum(len(g.unfinished_seqs()) for g in self.scheduler.running),
            num_running_requests=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped),
            block_size=bm.block_size,
            num_gpu_blocks=bm.gpu.num_blocks,
            num_free_gpu_blocks=bm.gpu.num_free,
            num_cpu_blocks=bm.cpu.num_blocks,
            num_free_cpu_blocks=bm.cpu.num_free,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_hits=bm.prefix_cache_hits,
            prefix_cache_queries=bm.prefix_cache_queries,
            blocks_used=sharing.used,
            blocks_unshared=sharing.unshared,
            sharing_saving=sharing.saving,
            num_copy_on_writes=bm.num_copy_on_writes,
            num_window_frees=bm.num_window_frees,
            kv_event_batches_dropped=self.kv_event_publisher.num_dropped if self.kv_event_publisher else 0,
            spec_decode=self.spec_decoder.stats.snapshot() if self.spec_decoder else None,
            **self.loras.stats(self.scheduler.waiting),
        )


def _close_all(closers: list[Callable[[], None]]) -> None:
    for close in closers:
        close()


def _open_kv_event_publisher(config: EngineConfig) -> ZmqEventPublisher | None:
    """The KV event publisher ``--kv-events-config`` asks for, or None when events are off.

    NOTE: pyzmq and msgspec are imported only here, so an engine without events runs without them.
    """
    if not config.cache.kv_events_enabled:
        return None
    assert config.cache.kv_events_config is not None
    try:
        from pagedllm.server.engine.kv_event_publisher import ZmqEventPublisher
    except ImportError as exc:
        raise ConfigError(
            "kv_events_config",
            config.cache.kv_events_config,
            f"install them (pip install pyzmq msgspec): {exc}",
            problem="needs pyzmq and msgspec",
            subject="{name}",
        ) from exc
    return ZmqEventPublisher(config.cache.kv_events_config)


def _with_token_budget(config: EngineConfig, device_type: str, max_model_len: int) -> EngineConfig:
    """``config`` with the per-iteration token budget resolved for the device it runs on."""
    budget = choose_token_budget(config.scheduler, device_type, max_model_len)
    logger.info("the scheduler batches up to %d tokens per step (%s)", budget.tokens, budget.reason)
    if budget.prefill_while_decoding is not None:
        logger.info("prompts take up to %d tokens of a step while more sequences decode", budget.prefill_while_decoding)
    return dataclasses.replace(config, scheduler=config.scheduler.with_token_budget(budget))


def _with_model_dir(config: EngineConfig) -> EngineConfig:
    """``config`` with the embedded demo model filled in when no model was given."""
    if config.model.model is not None:
        return config
    from pagedllm.server.demo import ensure_demo_model

    return dataclasses.replace(config, model=dataclasses.replace(config.model, model=ensure_demo_model()))
