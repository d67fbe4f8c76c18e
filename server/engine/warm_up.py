"""The engine's warm-up: one real request before the first user's, leaving no trace a user sees."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.server.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.server.engine.llm_engine import LLMEngine

WARM_UP_PROMPT_TOKENS = 256
"""Prompt tokens of :meth:`LLMEngine.warm_up`'s request (fewer where the model or the step budget is smaller)."""


def warm_up(engine: LLMEngine, max_steps: int = 100) -> None:
    """Run one real request, so a caller knows the model has run.

    NOTE: a prompt and two output tokens make a prefill step and a decode step, so both
    attention paths are compiled here (the CPU kernels by Numba, the Triton kernels on a
    GPU), not during the first user request. The prompt is as long as a typical one
    (:data:`WARM_UP_PROMPT_TOKENS`): the CPU's elementwise kernels have a build that
    spreads large (prefill) calls over the threads, and it compiles here too. The run
    leaves no trace a user sees: no cached prefix, no KV event, no prefix-cache counts.
    """
    eos = engine.model_info.eos_token_ids
    request_id = "pagedllm-warmup"
    length = max(2, min(WARM_UP_PROMPT_TOKENS, engine.max_model_len - 2, engine.config.scheduler.token_budget))
    bm = engine.block_manager
    counters = bm.prefix_cache_queries, bm.prefix_cache_hits
    engine._publish_kv_events()  # NOTE: what came before is announced; only the warm-up's own events are dropped
    publisher, engine.kv_event_publisher = engine.kv_event_publisher, None
    try:
        engine.add_request(
            request_id,
            {"prompt_token_ids": [eos[0] if eos else 0] * length},
            SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        )
        for _ in range(max_steps):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        else:
            engine.abort_request(request_id)
    finally:
        # NOTE: the warm-up's prompt is nobody's prefix: its blocks leave the prefix cache
        # unannounced, so KV event subscribers see the engine's first user block as event 0.
        bm.reset_prefix_cache()
        bm.take_kv_events()
        bm.prefix_cache_queries, bm.prefix_cache_hits = counters
        engine.kv_event_publisher = publisher
