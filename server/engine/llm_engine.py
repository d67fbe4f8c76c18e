"""The engine loop: requests in, one scheduled model step at a time, outputs back.

::

    add_request ─► InputProcessor (encode, validate) ─► Scheduler.waiting
    step():  Scheduler.schedule() ─► ModelRunner.execute() ─► Sampler / BeamSearch
             ─► OutputProcessor (text, stop checks) ─► [RequestOutput]
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pagedllm.server.config import ConfigError, EngineConfig
from pagedllm.server.core.block_manager import BlockManager
from pagedllm.server.core.scheduler import Scheduler
from pagedllm.server.core.sequence import Sequence, SequenceGroup
from pagedllm.server.engine.beam_search import BeamSearch, BeamState
from pagedllm.server.engine.input_processor import InputProcessor, PromptType
from pagedllm.server.engine.model_info import ModelInfo, load_tokenizer, read_model_info
from pagedllm.server.engine.output_processor import OutputProcessor
from pagedllm.server.engine.sampler import Sample, Sampler, SampleRequest, top_logprobs
from pagedllm.server.outputs import RequestOutput
from pagedllm.server.sampling_params import SamplingParams
from pagedllm.server.worker.model_loader import read_hf_config
from pagedllm.server.worker.model_runner import ModelRunner, StepResult


@dataclass
class EngineStats:
    """A snapshot of the engine's queues, cache and counters."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    num_preemptions: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    blocks_used: int
    blocks_unshared: int
    sharing_saving: float
    num_copy_on_writes: int


@dataclass
class RequestState:
    """What the engine keeps per request beside the scheduler's :class:`SequenceGroup`."""

    group: SequenceGroup
    generator: torch.Generator | None = None
    """The request's own random generator when it has a seed."""
    beam: BeamState | None = None
    """Hypotheses so far, for beam search requests."""


class LLMEngine:
    """Owns the scheduler, block manager, model runner and sampler for one model."""

    def __init__(self, config: EngineConfig) -> None:
        tp = config.parallel.tensor_parallel_size
        if tp != 1:
            raise ConfigError(
                "tensor_parallel_size", tp, "only 1 is supported by this build", problem="is not supported"
            )
        config = _with_model_dir(config)
        self.config = config
        assert config.model.model is not None
        hf_config = read_hf_config(config.model.model)
        self.tokenizer = (
            None if config.model.skip_tokenizer_init else load_tokenizer(config.model.tokenizer or config.model.model)
        )
        info = read_model_info(config, hf_config, self.tokenizer)
        self._check_scheduler_fits(info.max_model_len)
        self.runner = ModelRunner(config, hf_config, info.max_model_len)
        self.block_manager = self._allocate_cache(info.max_model_len)
        # NOTE: a single sequence must always fit in the cache on its own, else it could never finish.
        capacity = (self.block_manager.gpu.num_blocks - self.block_manager.watermark_blocks) * config.cache.block_size
        self.model_info: ModelInfo = dataclasses.replace(info, max_model_len=min(info.max_model_len, capacity))
        limit = self.model_info.max_model_len
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.sampler = Sampler(config.model.seed)
        self.input_processor = InputProcessor(self.tokenizer, info.vocab_size, limit, config.scheduler.max_num_seqs)
        self.output_processor = OutputProcessor(self.tokenizer, info.eos_token_ids, limit)
        self._seq_ids = itertools.count()
        self.beam_search = BeamSearch(self.block_manager, self.output_processor, self._next_seq_id)
        self._requests: dict[str, RequestState] = {}

    @property
    def max_model_len(self) -> int:
        return self.model_info.max_model_len

    def _check_scheduler_fits(self, max_model_len: int) -> None:
        sched = self.config.scheduler
        if not sched.enable_chunked_prefill and sched.token_budget < max_model_len:
            raise ConfigError(
                "max_num_batched_tokens",
                sched.token_budget,
                "raise it or enable chunked prefill",
                problem=f"is smaller than max_model_len={max_model_len}",
            )

    def _allocate_cache(self, max_model_len: int) -> BlockManager:
        config = self.config
        useful = config.scheduler.max_num_seqs * -(-max_model_len // config.cache.block_size)
        num_gpu_blocks = self.runner.num_device_blocks(useful)
        num_cpu_blocks = self.runner.num_host_blocks(useful)
        self.runner.allocate_cache(num_gpu_blocks, num_cpu_blocks)
        return BlockManager(config.cache.block_size, num_gpu_blocks, num_cpu_blocks, config.cache.enable_prefix_caching)

    def _next_seq_id(self) -> int:
        return next(self._seq_ids)

    # -- requests -----------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: PromptType, sampling_params: SamplingParams, arrival_time: float | None = None
    ) -> None:
        """Queue a request; an invalid prompt or parameters raise :class:`ConfigError` at once."""
        if request_id in self._requests:
            raise ConfigError("request_id", request_id, "give each request its own id", problem="is already in use")
        params = sampling_params
        processed = self.input_processor.process(prompt, params)
        group = SequenceGroup(
            request_id,
            [Sequence(self._next_seq_id(), processed.token_ids)],
            params,
            prompt=processed.text,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        )
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self._requests[request_id] = RequestState(group, generator, BeamState() if params.use_beam_search else None)
        self.scheduler.add(group)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop the request(s) wherever they are; their blocks are freed at once. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for group in self.scheduler.abort(ids):
            self._requests.pop(group.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the outputs of every request it advanced."""
        out = self.scheduler.schedule()
        touched = {id(g): g for g in out.ignored}
        if not out.is_empty:
            result = self.runner.execute(out, self.block_manager.tables)
            self.scheduler.mark_computed(out)
            self._record_prompt_logprobs(result)
            self._process_samples(result)
            touched.update((id(item.group), item.group) for item in out.scheduled)
        self.scheduler.free_finished()
        outputs = [self.output_processor.request_output(g) for g in touched.values()]
        for output in outputs:
            if output.finished:
                self._requests.pop(output.request_id, None)
        return outputs

    def _process_samples(self, result: StepResult) -> None:
        rows = result.inputs.sample_rows
        now = time.monotonic()
        beam_rows: dict[str, list[int]] = {}
        sampled = []
        for i, row in enumerate(rows):
            if row.group.first_token_time is None:
                row.group.first_token_time = now
            if row.group.sampling_params.use_beam_search:
                beam_rows.setdefault(row.group.request_id, []).append(i)
            else:
                sampled.append(i)
        if sampled:
            requests = [self._sample_request(rows[i].group, rows[i].seq) for i in sampled]
            samples = self.sampler(result.logits[sampled], requests)
            for i, sample in zip(sampled, samples):
                self._append(rows[i].group, rows[i].seq, sample)
        for request_id, indices in beam_rows.items():
            state = self._requests[request_id]
            assert state.beam is not None
            self.beam_search.step(state.group, state.beam, [rows[i].seq for i in indices], result.logits[indices])

    def _sample_request(self, group: SequenceGroup, seq: Sequence) -> SampleRequest:
        first = len(group.seqs) == 1 and not seq.output_token_ids
        return SampleRequest(
            group.sampling_params,
            seq.prompt_token_ids,
            seq.output_token_ids,
            num_samples=group.sampling_params.best_of if first else 1,
            generator=self._requests[group.request_id].generator,
            eos_token_ids=self.output_processor.eos_token_ids,
        )

    def _append(self, group: SequenceGroup, seq: Sequence, sample: Sample) -> None:
        """Append the sampled token; the group's first sample forks the other ``best_of - 1``."""
        params = group.sampling_params
        for i in range(1, len(sample.token_ids)):
            child = seq.fork(self._next_seq_id())
            self.block_manager.fork(seq, child)
            group.seqs.append(child)
            self.output_processor.append_token(
                child, sample.token_ids[i], sample.logprobs[i], sample.top_logprobs[i], params
            )
        self.output_processor.append_token(seq, sample.token_ids[0], sample.logprobs[0], sample.top_logprobs[0], params)

    def _record_prompt_logprobs(self, result: StepResult) -> None:
        rows = result.inputs.prompt_rows
        if not rows:
            return
        assert result.prompt_logits is not None
        logprobs = torch.log_softmax(result.prompt_logits.float().cpu(), dim=-1)
        index = 0
        for row in rows:
            group = row.group
            if not group.prompt_logprobs:
                group.prompt_logprobs = [None]  # the first prompt token has no logprob
            for position in row.prompt_positions:
                token = row.seq.prompt_token_ids[position]
                group.prompt_logprobs.append(
                    top_logprobs(logprobs[index], token, group.sampling_params.prompt_logprobs)
                )
                index += 1

    def warm_up(self, max_steps: int = 100) -> None:
        """Run one real one-token request, so a caller knows the model has run."""
        eos = self.model_info.eos_token_ids
        request_id = "pagedllm-warmup"
        self.add_request(
            request_id,
            {"prompt_token_ids": [eos[0] if eos else 0]},
            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        )
        for _ in range(max_steps):
            if not self.has_unfinished_requests():
                return
            self.step()
        self.abort_request(request_id)

    # -- state ----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        sharing = bm.sharing_stats()
        return EngineStats(
            num_running=sum(len(g.unfinished_seqs()) for g in self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped),
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
        )


def _with_model_dir(config: EngineConfig) -> EngineConfig:
    """``config`` with the embedded demo model filled in when no model was given."""
    if config.model.model is not None:
        return config
    from pagedllm.server.demo import ensure_demo_model

    return dataclasses.replace(config, model=dataclasses.replace(config.model, model=ensure_demo_model()))
