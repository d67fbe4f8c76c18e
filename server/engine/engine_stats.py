"""A snapshot of the engine's queues, cache and counters, as the API server's metrics read it.

NOTE: torch-free, like everything the API server process imports: the engine core sends
these over its socket (pickled) and the metrics render them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.server.engine.spec_decode.spec_decoder import SpecDecodeStats


@dataclass
class EngineStats:
    """A snapshot of the engine's queues, cache and counters."""

    num_running: int
    """Sequences running (a request with n > 1 or beams counts each)."""
    num_running_requests: int
    num_waiting: int
    num_swapped: int
    block_size: int
    """Tokens per KV cache block (the device's default when none was given)."""
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
    num_window_frees: int
    """Blocks released because they fell out of every layer's sliding window."""
    kv_event_batches_dropped: int = 0
    """KV event batches the publisher dropped because its queue was full (0 when events are off)."""
    spec_decode: SpecDecodeStats | None = None
    """Speculative decoding's proposals and acceptances since start (None when it is off)."""
    running_lora_adapters: tuple[str, ...] = ()
    """Names of the LoRA adapters running requests hold."""
    waiting_lora_adapters: tuple[str, ...] = ()
    """Names of the LoRA adapters of waiting requests."""
    max_lora: int = 0
    """Adapter slots (``max_loras``; 0 without LoRA)."""
