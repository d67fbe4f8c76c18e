"""The engine loop: requests in, one scheduled model step at a time, outputs back."""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch

from pagedllm.server.beam_search import BeamState, add_hypotheses, beam_step
from pagedllm.server.block_manager import BlockManager
from pagedllm.server.config import EngineConfig
from pagedllm.server.detokenizer import decode_new_text
from pagedllm.server.model_loader import read_hf_config
from pagedllm.server.model_runner import ModelRunner, StepResult
from pagedllm.server.outputs import CompletionOutput, RequestOutput
from pagedllm.server.sampler import Logprob, Sample, SampleRequest, Sampler, top_logprobs
from pagedllm.server.sampling_params import SamplingParams
from pagedllm.server.scheduler import Scheduler
from pagedllm.server.sequence import Sequence, SequenceGroup, SequenceStatus

PromptType = Union[str, dict, list]
MAX_LOGPROBS = 20


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


class LLMEngine:
    """Owns the scheduler, block manager, model runner and sampler for one model."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={config.parallel.tensor_parallel_size} is not supported "
                             "by this build: only 1 is allowed")
        self.config = config
        model_dir = config.model.model
        if model_dir is None:
            from pagedllm.server.demo import ensure_demo_model

            model_dir = ensure_demo_model()
            config = _replace_model(config, model_dir)
            self.config = config
        self.hf_config = read_hf_config(model_dir)
        self.tokenizer = None if config.model.skip_tokenizer_init else _load_tokenizer(
            config.model.tokenizer or model_dir)
        self.eos_token_ids = _eos_token_ids(model_dir, self.hf_config, self.tokenizer)
        self.max_model_len = _max_model_len(config, self.hf_config)
        self._check_scheduler_fits()
        self.runner = ModelRunner(config, self.hf_config, self.max_model_len)
        useful = config.scheduler.max_num_seqs * -(-self.max_model_len // config.cache.block_size)
        num_gpu_blocks = self.runner.num_device_blocks(useful)
        num_cpu_blocks = self.runner.num_host_blocks(useful)
        self.runner.allocate_cache(num_gpu_blocks, num_cpu_blocks)
        self.block_manager = BlockManager(config.cache.block_size, num_gpu_blocks, num_cpu_blocks,
                                          config.cache.enable_prefix_caching)
        # NOTE: a single sequence must always fit in the cache on its own, else it could never finish.
        capacity = (num_gpu_blocks - self.block_manager.watermark_blocks) * config.cache.block_size
        self.max_model_len = min(self.max_model_len, capacity)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.sampler = Sampler(config.model.seed)
        self.vocab_size = self.hf_config["vocab_size"]
        self._seq_ids = itertools.count()
        self._groups: dict[str, SequenceGroup] = {}

    def _check_scheduler_fits(self) -> None:
        sched = self.config.scheduler
        if not sched.enable_chunked_prefill and sched.token_budget < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens={sched.token_budget} is smaller than max_model_len="
                             f"{self.max_model_len}: raise it or enable chunked prefill")

    # -- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, sampling_params: SamplingParams,
                    arrival_time: Optional[float] = None) -> None:
        """Queue a request; invalid prompts or parameters raise ``ValueError`` at once."""
        if request_id in self._groups:
            raise ValueError(f"request_id={request_id!r} is already in use")
        text, token_ids = self._encode(prompt)
        params = sampling_params
        self._validate(token_ids, params)
        seq = Sequence(next(self._seq_ids), token_ids)
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        group = SequenceGroup(request_id, [seq], params, prompt=text,
                              arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
                              generator=generator, beam=BeamState() if params.use_beam_search else None)
        self._groups[request_id] = group
        self.scheduler.add(group)

    def _encode(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but skip_tokenizer_init=True: pass prompt_token_ids")
            return prompt, self.tokenizer.encode(prompt)
        raise ValueError(f"prompt={prompt!r} is invalid: pass a string or {{'prompt_token_ids': [...]}}")

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: at least one token is required")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids contain {bad[:3]}: ids must be integers in [0, {self.vocab_size})")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens is longer than max_model_len="
                             f"{self.max_model_len}")
        if len(token_ids) == self.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens leaves no room to generate within "
                             f"max_model_len={self.max_model_len}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > MAX_LOGPROBS:
                raise ValueError(f"{name}={value} is too large: at most {MAX_LOGPROBS}")
        bad_stops = [t for t in params.stop_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad_stops:
            raise ValueError(f"stop_token_ids contain {bad_stops[:3]}: ids must be integers in [0, {self.vocab_size})")
        if params.best_of > self.config.scheduler.max_num_seqs:
            raise ValueError(f"best_of={params.best_of} is larger than max_num_seqs="
                             f"{self.config.scheduler.max_num_seqs}, so the request could never run")
        if params.best_of > 1 and params.greedy and not params.use_beam_search:
            raise ValueError(f"best_of={params.best_of} needs random sampling: set temperature > 0")

    def abort_request(self, request_id: Union[str, list[str]]) -> None:
        """Stop the request(s) wherever they are; their blocks are freed at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for group in self.scheduler.abort(ids):
            self._groups.pop(group.request_id, None)

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
        outputs = [self._request_output(g) for g in touched.values()]
        for output in outputs:
            if output.finished:
                self._groups.pop(output.request_id, None)
        return outputs

    def _process_samples(self, result: StepResult) -> None:
        rows = result.inputs.sample_rows
        now = time.monotonic()
        beam_rows: dict[SequenceGroup, list[int]] = {}
        sampled = []
        for i, row in enumerate(rows):
            if row.group.first_token_time is None:
                row.group.first_token_time = now
            if row.group.beam is not None:
                beam_rows.setdefault(row.group, []).append(i)
            else:
                sampled.append(i)
        if sampled:
            requests = [self._sample_request(rows[i].group, rows[i].seq) for i in sampled]
            samples = self.sampler(result.logits[sampled], requests)
            for i, sample in zip(sampled, samples):
                self._append(rows[i].group, rows[i].seq, sample)
        for group, indices in beam_rows.items():
            self._beam_step(group, [rows[i].seq for i in indices], result.logits[indices])

    def _sample_request(self, group: SequenceGroup, seq: Sequence) -> SampleRequest:
        first = len(group.seqs) == 1 and not seq.output_token_ids
        return SampleRequest(group.sampling_params, seq.prompt_token_ids, seq.output_token_ids,
                             num_samples=group.sampling_params.best_of if first else 1,
                             generator=group.generator, eos_token_ids=self.eos_token_ids)

    def _append(self, group: SequenceGroup, seq: Sequence, sample: Sample) -> None:
        """Append the sampled token; the group's first sample forks the other ``best_of - 1``."""
        for i in range(1, len(sample.token_ids)):
            child = seq.fork(next(self._seq_ids))
            self.block_manager.fork(seq, child)
            group.seqs.append(child)
            self._append_token(group, child, sample.token_ids[i], sample.logprobs[i], sample.top_logprobs[i])
        self._append_token(group, seq, sample.token_ids[0], sample.logprobs[0], sample.top_logprobs[0])

    def _append_token(self, group: SequenceGroup, seq: Sequence, token: int, logprob: float,
                      top: Optional[dict[int, Logprob]]) -> None:
        if top is not None and self.tokenizer is not None:
            for token_id, entry in top.items():
                entry.decoded_token = self.tokenizer.decode([token_id])
        seq.append_token(token, logprob, top)
        params = group.sampling_params
        if self.tokenizer is not None:
            seq.output_text += decode_new_text(self.tokenizer, seq, params.skip_special_tokens)
        self._check_stop(seq, params)

    def _beam_step(self, group: SequenceGroup, beams: list[Sequence], logits: torch.Tensor) -> None:
        """Advance a beam search by one token: fork kept beams, free dropped ones, record hypotheses."""
        params = group.sampling_params
        gen_len = len(beams[0].output_token_ids) + 1
        at_limit = (params.max_tokens is not None and gen_len >= params.max_tokens) or \
            len(beams[0]) + 1 >= self.max_model_len
        logprobs = torch.log_softmax(logits.float().cpu(), dim=-1)
        step = beam_step(group.beam, beams, logprobs, params, self.eos_token_ids, at_limit)
        hypotheses = []
        for cand in step.finished:
            hyp = cand.parent.fork(next(self._seq_ids))  # NOTE: holds no blocks; it is only an output
            self._append_beam_token(hyp, cand.token, cand.logprob, params)
            hyp.status = SequenceStatus.FINISHED_STOPPED if cand.token in self.eos_token_ids and \
                not params.ignore_eos else SequenceStatus.FINISHED_LENGTH
            hypotheses.append((cand.score / gen_len ** params.length_penalty, hyp))
        add_hypotheses(group.beam, hypotheses, params.best_of)
        if step.done:
            for beam in beams:
                self.block_manager.free(beam)
            group.seqs = [hyp for _, hyp in group.beam.hypotheses]
            return
        group.seqs = self._fork_beams(beams, step.running, params)

    def _fork_beams(self, beams: list[Sequence], running, params: SamplingParams) -> list[Sequence]:
        children: dict[Sequence, list] = {}
        for cand in running:
            children.setdefault(cand.parent, []).append(cand)
        kept = []
        for parent in beams:
            cands = children.get(parent)
            if not cands:
                self.block_manager.free(parent)  # a dropped beam: its blocks lose a reference
                continue
            for cand in cands[1:]:
                child = parent.fork(next(self._seq_ids))
                self.block_manager.fork(parent, child)
                self._append_beam_token(child, cand.token, cand.logprob, params)
                kept.append(child)
            self._append_beam_token(parent, cands[0].token, cands[0].logprob, params)
            kept.append(parent)
        return sorted(kept, key=lambda s: s.cumulative_logprob, reverse=True)

    def _append_beam_token(self, seq: Sequence, token: int, logprob: float, params: SamplingParams) -> None:
        seq.append_token(token, logprob, None)
        if self.tokenizer is not None:
            seq.output_text += decode_new_text(self.tokenizer, seq, params.skip_special_tokens)

    def _check_stop(self, seq: Sequence, params: SamplingParams) -> None:
        token = seq.output_token_ids[-1]
        num_out = len(seq.output_token_ids)
        if num_out >= params.min_tokens and self._stop_string_matched(seq, params):
            return
        if num_out >= params.min_tokens and token in params.stop_token_ids:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        elif num_out >= params.min_tokens and not params.ignore_eos and token in self.eos_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif (params.max_tokens is not None and num_out >= params.max_tokens) or len(seq) >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH

    @staticmethod
    def _stop_string_matched(seq: Sequence, params: SamplingParams) -> bool:
        for stop in params.stop_list:
            index = seq.output_text.find(stop)
            if index >= 0:
                end = index + len(stop) if params.include_stop_str_in_output else index
                seq.output_text = seq.output_text[:end]
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
                return True
        return False

    def _record_prompt_logprobs(self, result: StepResult) -> None:
        rows = result.inputs.prompt_rows
        if not rows:
            return
        logprobs = torch.log_softmax(result.prompt_logits.float().cpu(), dim=-1)
        index = 0
        for row in rows:
            group = row.group
            if not group.prompt_logprobs:
                group.prompt_logprobs = [None]  # the first prompt token has no logprob
            for position in row.prompt_positions:
                token = row.seq.prompt_token_ids[position]
                group.prompt_logprobs.append(top_logprobs(logprobs[index], token,
                                                          group.sampling_params.prompt_logprobs))
                index += 1

    # -- outputs ------------------------------------------------------------------------
    def _request_output(self, group: SequenceGroup) -> RequestOutput:
        params = group.sampling_params
        finished = group.is_finished()
        seqs = group.seqs
        if finished and len(seqs) > params.n and group.beam is None:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)
        completions = [
            CompletionOutput(index=i, text=s.output_text, token_ids=list(s.output_token_ids),
                             cumulative_logprob=s.cumulative_logprob,
                             logprobs=list(s.output_logprobs) if params.logprobs is not None else None,
                             finish_reason=s.status.value if s.status.finished else None,
                             stop_reason=s.stop_reason)
            for i, s in enumerate(seqs[:params.n])
        ]
        prompt_logprobs = group.prompt_logprobs if params.prompt_logprobs is not None else None
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, prompt_logprobs,
                             completions, finished)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        sharing = bm.sharing_stats()
        return EngineStats(
            num_running=sum(len(g.unfinished_seqs()) for g in self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), num_swapped=len(self.scheduler.swapped),
            num_gpu_blocks=bm.gpu.num_blocks, num_free_gpu_blocks=bm.gpu.num_free,
            num_cpu_blocks=bm.cpu.num_blocks, num_free_cpu_blocks=bm.cpu.num_free,
            num_preemptions=self.scheduler.num_preemptions, prefix_cache_hits=bm.prefix_cache_hits,
            prefix_cache_queries=bm.prefix_cache_queries, blocks_used=sharing.used,
            blocks_unshared=sharing.unshared, sharing_saving=sharing.saving,
            num_copy_on_writes=bm.num_copy_on_writes)


def _replace_model(config: EngineConfig, model_dir: str) -> EngineConfig:
    import dataclasses

    return dataclasses.replace(config, model=dataclasses.replace(config.model, model=model_dir))


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _eos_token_ids(model_dir: str, hf_config: dict, tokenizer) -> tuple[int, ...]:
    ids = hf_config.get("eos_token_id")
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            ids = json.load(f).get("eos_token_id", ids)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, list) else (ids,)


def _max_model_len(config: EngineConfig, hf_config: dict) -> int:
    limit = hf_config.get("max_position_embeddings") or hf_config.get("n_positions") or 2048
    if hf_config.get("sliding_window"):
        limit = min(limit, hf_config["sliding_window"])
    asked = config.model.max_model_len
    if asked is not None and asked > limit:
        raise ValueError(f"max_model_len={asked} is larger than the model's limit of {limit} positions")
    return asked or limit
