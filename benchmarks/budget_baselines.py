"""The ``transformers`` baselines given the same KV budget as the engine.

- Static batches (``generate``): a batch holds a contiguous, padded cache of
  ``batch × (longest prompt + longest output)`` token slots, so the largest batch that
  fits the budget is formed first-come-first-served from the requests that have arrived
  (sized with the real output lengths, which flatters the baseline). Served online on
  the same simulated clock as the engine (:mod:`sim`): when idle, the server takes the
  next batch; every request of a batch finishes when the batch does.
- Continuous batching (``transformers``' own paged cache): the paged cache gets exactly
  the budget (``num_blocks × page_size``, the engine's block size). Its manager runs on
  its own thread in real time, so it is measured offline (all requests queued at once);
  requests completed per second then bound from above any rate it could sustain.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from benchmarks.hf_baselines import PAD_ID, Request, _left_padded, _load, serve_continuous
from benchmarks.sim import Roofline


def padded_slots(batch: Sequence[Request]) -> int:
    """Token slots a static batch's contiguous cache holds."""
    return len(batch) * (max(len(r.prompt_token_ids) for r in batch) + max(r.output_len for r in batch))


def next_batch(waiting: Sequence[Request], budget_tokens: int) -> int:
    """How many of the oldest waiting requests one static batch can take (at least one)."""
    size = 1
    while size < len(waiting) and padded_slots(waiting[: size + 1]) <= budget_tokens:
        size += 1
    return size


BatchSeconds = Callable[[Sequence[Request]], float]


def measured_batch(model) -> BatchSeconds:
    """Seconds ``generate`` takes for a static batch, measured."""
    return lambda batch: _generate(model, batch)


def roofline_batch(roofline: Roofline) -> BatchSeconds:
    """Seconds a static batch would take under ``roofline``: a padded prefill, then every
    decode step reads the weights and the whole padded cache, until the longest output ends."""

    def seconds(batch: Sequence[Request]) -> float:
        size, width = len(batch), max(len(r.prompt_token_ids) for r in batch)
        total = roofline.step_seconds(size * width, 0)
        for t in range(max(r.output_len for r in batch) - 1):
            total += roofline.step_seconds(size, size * (width + t + 1))
        return total

    return seconds


@torch.inference_mode()
def _generate(model, batch: Sequence[Request]) -> float:
    ids, mask = _left_padded(batch)
    new = max(r.output_len for r in batch)  # a static batch runs until its longest request ends
    start = time.perf_counter()
    model.generate(
        ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=PAD_ID
    )
    return time.perf_counter() - start


def hf_static_online(
    batch_seconds: BatchSeconds, requests: Sequence[Request], arrivals: Sequence[float], budget_tokens: int
) -> tuple[float, float]:
    """Normalized latency (s/token) of static batches served on the simulated clock, and the duration."""
    clock, done, latencies = 0.0, 0, []
    while done < len(requests):
        clock = max(clock, arrivals[done])
        arrived = int(np.searchsorted(arrivals, clock, side="right"))
        size = next_batch(requests[done:arrived], budget_tokens)
        batch = requests[done : done + size]
        clock += batch_seconds(batch)
        latencies += [(clock - arrivals[done + i]) / r.output_len for i, r in enumerate(batch)]
        done += size
    return float(np.mean(latencies)), clock


@torch.inference_mode()
def hf_continuous_capacity(
    model_dir: str, requests: Sequence[Request], budget_tokens: int, page: int, batch_tokens: int
) -> float:
    """Requests per second of ``transformers``' continuous batching with a paged cache of the budget
    and ``batch_tokens`` per step (the engine's ``max_num_batched_tokens``)."""
    from transformers import ContinuousBatchingConfig

    model = _load(model_dir)
    cb = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=budget_tokens // page,
        max_requests_per_batch=256,  # as the engine's max_num_seqs: memory decides
        max_batch_tokens=batch_tokens,
        auto_switch_to_flash=False,
        use_cuda_graph=False,
    )
    return len(requests) / serve_continuous(model, requests, cb, "transformers continuous")
