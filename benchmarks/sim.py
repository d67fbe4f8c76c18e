"""Serving on a simulated clock: Poisson arrivals replayed against the real engine.

The engine runs every step for real (scheduler, block manager, model forward, sampling);
only the clock is simulated. It advances by the measured wall time of each step, and
jumps over idle gaps to the next arrival, so a request's latency is what it would have
been had it arrived at that moment to a server running at this machine's speed, without
waiting through the idle time in real time. A request arrives when the clock passes its
arrival time and is added before the next step, as a server would between iterations.

Per-step samples record the KV cache split the paper's Fig. 2 uses (token slots):

    used       KV of tokens already computed
    reserved   slots held or promised for tokens the request will still generate
    internal   slots held or promised that no token will ever fill (over-reservation,
               the unfilled tail of a last block)
    free       blocks nobody holds (includes cached-but-evictable blocks)

waste = 1 - used / all slots.

A step is memory-bound when a request waits and the block manager cannot admit the first
one in line (its blocks, or its reservation, do not fit): the steps Figs. 2 and 13 average
over. Requests that wait for another reason (the step's token budget, ``max_num_seqs``)
do not make a step memory-bound.

Two clocks. ``measured``: each step's wall time on this machine. ``roofline``: the time the
same step (the engine's real schedule) would take for LLaMA-7B in fp16 on an A100-40GB,
the larger of weights + KV read over memory bandwidth and 2 x params x tokens over peak
FLOP/s; a model, not a measurement, that keeps the property the paper's result rests on:
a decode step costs about the same whatever the batch size, so memory decides throughput.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedllm.server import SamplingParams
from pagedllm.server.core.block_manager import AllocStatus
from pagedllm.server.core.sequence import Sequence as Sequence_
from pagedllm.server.core.sequence import SequenceStatus
from pagedllm.server.engine.llm_engine import LLMEngine


@dataclass
class KVSample:
    """One step's KV cache split, in token slots, and the requests in it."""

    used: int
    reserved: int
    internal: int
    free: int
    running: int
    waiting: int
    memory_bound: bool = False
    """A request waited because the cache could not take it (see the module docstring)."""

    @property
    def total(self) -> int:
        return self.used + self.reserved + self.internal + self.free


@dataclass
class ReplayResult:
    """Latencies (simulated seconds) and per-step samples of one run."""

    latency: dict[str, float] = field(default_factory=dict)
    output_len: dict[str, int] = field(default_factory=dict)
    samples: list[KVSample] = field(default_factory=list)
    duration: float = 0.0
    steps: int = 0
    tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def normalized_latency(self) -> float:
        """The paper's metric: mean over requests of end-to-end latency / output tokens (s/token)."""
        return float(np.mean([self.latency[r] / max(1, self.output_len[r]) for r in self.latency]))

    def mean_over_bound_steps(self) -> dict[str, float]:
        """Averages over the memory-bound steps; over all steps, with ``memory_bound_steps`` 0,
        when memory never decided (the budget held every request)."""
        bound = [s for s in self.samples if s.memory_bound] or self.samples
        num_bound = sum(s.memory_bound for s in self.samples)
        slots = sum(s.total for s in bound) or 1
        return {
            "used_pct": 100 * sum(s.used for s in bound) / slots,
            "reserved_pct": 100 * sum(s.reserved for s in bound) / slots,
            "internal_pct": 100 * sum(s.internal for s in bound) / slots,
            "free_pct": 100 * sum(s.free for s in bound) / slots,
            "waste_pct": 100 - 100 * sum(s.used for s in bound) / slots,
            "running": float(np.mean([s.running for s in bound])) if bound else 0.0,
            "memory_bound_steps": num_bound,
        }


def kv_sample(engine: LLMEngine, final_len: dict[str, int]) -> KVSample:
    """The cache split now; ``final_len`` is each request's prompt + output length."""
    bm = engine.block_manager
    bs = bm.block_size
    used = reserved = internal = held_slots = 0
    for group in engine.scheduler.running:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            if seq.seq_id not in bm.tables:
                continue
            slots = (len(bm.block_table(seq)) + bm.reserved_blocks(seq)) * bs
            will_use = min(slots, final_len[group.request_id])
            used += seq.num_computed_tokens
            reserved += max(0, will_use - seq.num_computed_tokens)
            internal += slots - will_use
            held_slots += slots
    waiting = engine.scheduler.waiting
    free = bm.gpu.num_blocks * bs - held_slots
    bound = bool(waiting) and bm.can_allocate(waiting[0]) is not AllocStatus.OK
    return KVSample(used, reserved, internal, free, len(engine.scheduler.running), len(waiting), bound)


@dataclass(frozen=True)
class Roofline:
    """An idealized GPU step time from bytes moved and FLOPs (LLaMA-7B, fp16, A100-40GB)."""

    params: float = 6.74e9
    bytes_per_param: int = 2
    kv_bytes_per_token: int = 2 * 32 * 4096 * 2  # K and V, 32 layers, hidden 4096, fp16
    bandwidth: float = 1.555e12  # bytes/s
    peak_flops: float = 312e12  # fp16 tensor cores

    def step_seconds(self, new_tokens: int, context_tokens: int) -> float:
        memory = (self.params * self.bytes_per_param + context_tokens * self.kv_bytes_per_token) / self.bandwidth
        return max(memory, 2 * self.params * new_tokens / self.peak_flops)


def _computed(engine: LLMEngine) -> dict[int, tuple[Sequence_, int]]:
    sched = engine.scheduler
    groups = [*sched.running, *sched.waiting, *sched.swapped]
    return {id(s): (s, s.num_computed_tokens) for g in groups for s in g.seqs}


def _step_shape(before: dict) -> tuple[int, int]:
    """Tokens computed by the step and the KV context its attention read."""
    new = context = 0
    for seq, computed in before.values():
        delta = seq.num_computed_tokens - computed
        if delta > 0:
            new += delta
            context += seq.num_computed_tokens
    return new, context


ParamsFor = Callable[[int], SamplingParams]


def replay(
    engine: LLMEngine,
    prompts: Sequence[list[int]],
    arrivals: Sequence[float],
    params_for: ParamsFor,
    final_len: Sequence[int] | None = None,
    keep_tokens: bool = False,
    on_step: Callable[[LLMEngine], None] | None = None,
    roofline: Roofline | None = None,
) -> ReplayResult:
    """Run the requests, request i arriving at ``arrivals[i]`` on the simulated clock
    (measured step times, or ``roofline``'s for the same steps)."""
    result = ReplayResult()
    finals = {str(i): n for i, n in enumerate(final_len)} if final_len is not None else None
    clock, next_i = 0.0, 0
    while next_i < len(prompts) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            clock = max(clock, arrivals[next_i])  # idle: skip to the next arrival
        while next_i < len(prompts) and arrivals[next_i] <= clock:
            engine.add_request(str(next_i), {"prompt_token_ids": prompts[next_i]}, params_for(next_i), arrivals[next_i])
            next_i += 1
        before = _computed(engine) if roofline else {}
        start = time.perf_counter()
        outputs = engine.step()
        clock += roofline.step_seconds(*_step_shape(before)) if roofline else time.perf_counter() - start
        result.steps += 1
        if finals is not None:
            result.samples.append(kv_sample(engine, finals))
        if on_step is not None:
            on_step(engine)
        for out in outputs:
            if out.finished:
                i = int(out.request_id)
                result.latency[out.request_id] = clock - arrivals[i]
                result.output_len[out.request_id] = len(out.outputs[0].token_ids)
                if keep_tokens:
                    result.tokens[out.request_id] = list(out.outputs[0].token_ids)
    result.duration = clock
    return result
