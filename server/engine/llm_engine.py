"""The engine loop: requests in, one scheduled model step at a time, outputs back.

::

    add_request ─► InputProcessor (encode, validate) ─► Scheduler.waiting
    step():  Scheduler.schedule() ─► StepBuilder.build() + SamplingRows.build() ─► Executor.execute(SchedulerOutput)
             (every rank's worker runs the model, rank 0 samples on its device: tokens back) ─►
             StepResults, BeamSearch, SpecDecoder, OutputProcessor decide (tokens, text, stop checks,
             forks) ─► Scheduler.update_from_output applies ─► [RequestOutput | EmbeddingRequestOutput]

With ``async_scheduling`` the next step is scheduled and launched before the step in flight is
processed (:mod:`pagedllm.server.engine.async_steps`); :meth:`LLMEngine.step` then returns the
outputs of the step before the one it launched.

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

from pagedllm.server.config import ConfigError, EngineConfig
from pagedllm.server.core.block_manager import BlockManager
from pagedllm.server.core.lora_slots import LoRASlots
from pagedllm.server.core.scheduler import Scheduler
from pagedllm.server.core.sequence import Sequence, SequenceGroup
from pagedllm.server.engine import engine_setup as setup
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
from pagedllm.server.engine.step_end import collect_outputs, step_failed
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
        config = setup.with_model_dir(config)
        self.config = config
        assert config.model.model is not None
        hf_config = read_hf_config(config.model.model)
        self.tokenizer = (
            None if config.model.skip_tokenizer_init else load_tokenizer(config.model.tokenizer or config.model.model)
        )
        info = read_model_info(config, hf_config, self.tokenizer)
        device_type = Executor.device_type(config.model.device)
        config = setup.with_token_budget(config, device_type, info.max_model_len)
        config = self.config = dataclasses.replace(config, cache=config.cache.with_block_size(device_type))
        setup.check_scheduler_fits(config, info.max_model_len)
        setup.check_speculation(config)
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
        self._finalizer = weakref.finalize(self, setup.close_all, self._closers)
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
        self.kv_event_publisher = setup.open_kv_event_publisher(config)
        if self.kv_event_publisher is not None:
            self._closers.insert(0, self.kv_event_publisher.close)
        self.block_manager = self._allocate_cache(info.max_model_len, info.kv_window)
        # NOTE: a single sequence must always fit in the cache on its own, else it could never finish.
        bm = self.block_manager
        capacity = (bm.gpu.num_blocks - bm.watermark_blocks) * bm.block_size
        self.model_info: ModelInfo = dataclasses.replace(
            info, max_model_len=min(info.max_model_len, capacity), weights=self.runner.weights
        )
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
        spec, bm = config.scheduler.speculative_config, self.block_manager
        self.spec_decoder = SpecDecoder(spec, self.output_processor, bm, self._requests, self.draft) if spec else None
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
        self.pipeline = setup.async_steps(config)
        """Steps scheduled ahead (``async_scheduling``); None: every step runs in turn."""

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's worker, in this process (its model, cache and sampler; tests and benchmarks read it)."""
        return self.executor.driver

    @property
    def max_model_len(self) -> int:
        return self.model_info.max_model_len

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
        setup.expect_length(self.block_manager, seq, sampling, pooling, self.max_model_len)
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

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop the request(s) wherever they are; their blocks are freed at once. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if self.pipeline is not None:
            self.pipeline.drain(self, ids)  # NOTE: never abort under a running step
        for group in self.scheduler.abort(ids):
            self._forget(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or (self.pipeline is not None and self.pipeline.busy)

    # -- the step -----------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Run one iteration; return the outputs of every request it advanced.

        NOTE: a failure in one request's work (sampling, stop checks, text, logprobs, beam
        bookkeeping) fails that request alone; a failed model step fails the step's
        requests. Either way their blocks are freed and the engine goes on, unless the
        bookkeeping no longer adds up or steps keep failing (:class:`EngineFatalError`).
        """
        self._check_open()
        if self.pipeline is not None:
            return self.pipeline.step(self)
        if self.spec_decoder is not None:
            self.scheduler.set_proposals(self.spec_decoder.propose(self.scheduler.running, self.max_model_len))
        out = self.scheduler.schedule()
        touched = {id(g): g for g in out.ignored}
        failed: dict[str, str] = {}
        updates = None
        if not out.is_empty:
            self.count_step()
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
                step_failed(self, out, exc, failed, touched)
            else:
                updates = self.step_results.decide(result, failed)
        self.scheduler.update_from_output(out, updates, failed)  # NOTE: the one place sequences change
        return collect_outputs(self, touched, failed)

    def count_step(self) -> None:
        self._num_steps += 1

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

    def _allocate_cache(self, max_model_len: int, kv_window: int | None) -> BlockManager:
        kv_events = self.kv_event_publisher is not None
        return setup.allocate_cache(self.config, self.executor, self.draft, kv_events, max_model_len, kv_window)

    def describe(self, host: str | None = None, port: int | None = None) -> str:
        """The start-up summary a person reads: what runs where, and how much cache it has."""
        return setup.describe(self, host, port)

    def warm_up(self, max_steps: int = 100) -> None:
        """Run one real request, so a caller knows the model has run (:func:`warm_up`)."""
        warm_up(self, max_steps)

    # -- state ----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return setup.engine_stats(self)
