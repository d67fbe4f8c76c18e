"""How an :class:`~pagedllm.server.engine.llm_engine.LLMEngine` is put together and reported:
its configuration resolved for the device, the KV cache sized and allocated, the speculative
decoder chosen, and the start-up banner and statistics read off its parts.

NOTE: plain functions over the engine's parts, so the engine class keeps the request and
step loop alone; no torch here either.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedllm.server.config import ConfigError, EngineConfig, choose_token_budget
from pagedllm.server.core.block_manager import BlockManager
from pagedllm.server.core.kv_reservation import KVReservation
from pagedllm.server.core.sequence import Sequence
from pagedllm.server.engine.engine_stats import EngineStats
from pagedllm.server.pooling_params import PoolingParams
from pagedllm.server.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.server.engine.async_steps import AsyncSteps
    from pagedllm.server.engine.kv_event_publisher import ZmqEventPublisher
    from pagedllm.server.engine.llm_engine import LLMEngine
    from pagedllm.server.engine.spec_decode.draft_model import DraftModel
    from pagedllm.server.executor import Executor

logger = logging.getLogger("pagedllm.engine")


# -- configuration ------------------------------------------------------------------------
def with_model_dir(config: EngineConfig) -> EngineConfig:
    """``config`` with the embedded demo model filled in when no model was given."""
    if config.model.model is not None:
        return config
    from pagedllm.server.demo import ensure_demo_model

    return dataclasses.replace(config, model=dataclasses.replace(config.model, model=ensure_demo_model()))


def with_token_budget(config: EngineConfig, device_type: str, max_model_len: int) -> EngineConfig:
    """``config`` with the per-iteration token budget resolved for the device it runs on."""
    budget = choose_token_budget(config.scheduler, device_type, max_model_len)
    logger.info("the scheduler batches up to %d tokens per step (%s)", budget.tokens, budget.reason)
    if budget.prefill_while_decoding is not None:
        logger.info("prompts take up to %d tokens of a step while more sequences decode", budget.prefill_while_decoding)
    return dataclasses.replace(config, scheduler=config.scheduler.with_token_budget(budget))


def check_scheduler_fits(config: EngineConfig, max_model_len: int) -> None:
    """Without chunked prefill, a whole prompt of ``max_model_len`` tokens must fit one step."""
    sched = config.scheduler
    if not sched.enable_chunked_prefill and sched.token_budget < max_model_len:
        raise ConfigError(
            "max_num_batched_tokens",
            sched.token_budget,
            "raise it, leave it unset, or enable chunked prefill",
            problem=f"is smaller than max_model_len={max_model_len}",
        )


def check_speculation(config: EngineConfig) -> None:
    """Speculative decoding needs the paged cache (a reservation cannot hold the proposals)."""
    spec = config.scheduler.speculative_config
    if spec is not None and config.cache.kv_reservation != "paged":
        raise ConfigError(
            "speculative_config",
            spec,
            "use kv_reservation='paged' with speculative decoding",
            problem=f"is not supported with kv_reservation={config.cache.kv_reservation!r}",
            subject="{name}",
        )


def async_steps(config: EngineConfig) -> AsyncSteps | None:
    """The engine's steps scheduled ahead with ``async_scheduling``; None: every step runs in turn
    (the option is off, or speculative decoding, which plans each step from the one before, is on)."""
    if not config.scheduler.async_scheduling:
        return None
    if config.scheduler.speculative_config is not None:
        logger.info("async scheduling is off: speculative decoding runs every step in turn")
        return None
    from pagedllm.server.engine.async_steps import AsyncSteps

    return AsyncSteps()


def open_kv_event_publisher(config: EngineConfig) -> ZmqEventPublisher | None:
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


def close_all(closers: list[Callable[[], None]]) -> None:
    for close in closers:
        close()


# -- the KV cache -------------------------------------------------------------------------
def allocate_cache(
    config: EngineConfig,
    executor: Executor,
    draft: DraftModel | None,
    kv_events: bool,
    max_model_len: int,
    kv_window: int | None,
) -> BlockManager:
    """Size the cache (the draft model's, if any, takes its share of the same memory, block for
    block), allocate it on every rank and return the block manager over it."""
    useful = config.scheduler.max_num_seqs * -(-max_model_len // config.cache.tokens_per_block)
    num_cpu_blocks = executor.num_host_blocks(useful)
    if draft is None or config.cache.num_gpu_blocks_override is not None:
        num_gpu_blocks = executor.num_device_blocks(useful)
    else:
        target, both = executor.block_bytes, executor.block_bytes + draft.block_bytes
        num_gpu_blocks = max(1, executor.num_device_blocks(-(-useful * both // target)) * target // both)
    executor.allocate_cache(num_gpu_blocks, num_cpu_blocks)
    if draft is not None:
        draft.allocate(num_gpu_blocks)
    bm = BlockManager(
        config.cache.tokens_per_block,
        num_gpu_blocks,
        num_cpu_blocks,
        config.cache.enable_prefix_caching,
        sliding_window=kv_window,
        kv_events=kv_events,
    )
    if config.cache.kv_reservation != "paged":
        # NOTE: no reservation exceeds what the cache can hold, or Orca (Max) could admit nothing.
        capacity = (bm.gpu.num_blocks - bm.watermark_blocks) * bm.block_size
        bm.reservation = KVReservation(config.cache.kv_reservation, bm.block_size, min(max_model_len, capacity))
    return bm


def expect_length(
    bm: BlockManager, seq: Sequence, params: SamplingParams, pooling: PoolingParams | None, max_model_len: int
) -> None:
    """Tell a reservation-based allocator (benchmarks) how long the request can grow."""
    reservation = bm.reservation
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
    reservation.expect(seq.seq_id, len(seq) + (params.max_tokens or max_model_len))


# -- reporting ----------------------------------------------------------------------------
def describe(engine: LLMEngine, host: str | None = None, port: int | None = None) -> str:
    """The start-up summary a person reads: what runs where, and how much cache it has."""
    runner, bm, config = engine.runner, engine.block_manager, engine.config
    lines = [
        f"model            {config.model.model}",
        f"weights          {runner.weights.banner()}",
        f"dtype / device   {str(runner.dtype).removeprefix('torch.')} on {runner.device}"
        f" x {config.parallel.tensor_parallel_size} rank(s), {runner.threads.threads} CPU thread(s)",
        f"attention        {runner.ops.name}",
        f"KV cache blocks  {bm.gpu.num_blocks} device + {bm.cpu.num_blocks} host,"
        f" {config.cache.tokens_per_block} tokens each of {str(runner.cache_dtype).removeprefix('torch.')}",
        f"max model len    {engine.max_model_len} tokens, max {config.scheduler.max_num_seqs} sequences"
        f" and {config.scheduler.token_budget} tokens per step",
    ]
    if engine.spec_decoder is not None:
        lines.append(f"speculative      {engine.spec_decoder.describe()}")
    if host is not None:
        lines.append(f"serving          http://{host}:{port}/v1 (docs at /docs)")
    return "ready\n  " + "\n  ".join(lines)


def engine_stats(engine: LLMEngine) -> EngineStats:
    """The engine's queues, cache, sharing, speculation and adapters, as of now."""
    bm, scheduler, publisher = engine.block_manager, engine.scheduler, engine.kv_event_publisher
    sharing = bm.sharing_stats()
    return EngineStats(
        num_running=sum(len(g.unfinished_seqs()) for g in scheduler.running),
        num_running_requests=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.swapped),
        block_size=bm.block_size,
        num_gpu_blocks=bm.gpu.num_blocks,
        num_free_gpu_blocks=bm.gpu.num_free,
        num_cpu_blocks=bm.cpu.num_blocks,
        num_free_cpu_blocks=bm.cpu.num_free,
        num_preemptions=scheduler.num_preemptions,
        prefix_cache_hits=bm.prefix_cache_hits,
        prefix_cache_queries=bm.prefix_cache_queries,
        blocks_used=sharing.used,
        blocks_unshared=sharing.unshared,
        sharing_saving=sharing.saving,
        num_copy_on_writes=bm.num_copy_on_writes,
        num_window_frees=bm.num_window_frees,
        kv_event_batches_dropped=publisher.num_dropped if publisher else 0,
        spec_decode=engine.spec_decoder.stats.snapshot() if engine.spec_decoder else None,
        **engine.loras.stats(scheduler.waiting),
    )
