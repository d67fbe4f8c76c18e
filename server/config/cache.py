"""The KV cache: block size, how much memory it takes, prefix caching and its events."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pagedllm.server.config.checks import ConfigError, check_choice, check_range, field_help
from pagedllm.server.config.kv_events import KVEventsConfig
from pagedllm.server.config.model import DEVICES

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
"""What the KV cache stores: ``auto`` the model's dtype; 8-bit formats described in kernels/kv_quant.py."""
KV_RESERVATIONS = ("paged", "max", "pow2", "oracle")  # kept equal to core.kv_reservation's (config stays import-light)
GiB = 1 << 30


DEFAULT_BLOCK_SIZES = {"cpu": 64, "cuda": 16}
"""Tokens per KV cache block when ``block_size`` is unset, by device type.

NOTE: the CPU decode kernel reads a sequence's blocks one after another, and each block
that lies elsewhere in memory starts a new stream the CPU's prefetcher has to find: at 16
tokens (16-32 KB per layer) the kernel waits on memory. At 64 it takes 25-40% less time
per call (``python -m benchmarks.cpu_attention --block-sizes 16 64 --layers 8``) and a
decode step 0.4-1 ms less (``benchmarks/step_profile.py``); vLLM's CPU build defaults to
128 for the same reason. The cost is coarser sharing: prefix caching reuses whole blocks
only, and a fork copies up to a block. On CUDA 16 is vLLM's default.
"""


@dataclass(frozen=True)
class CacheConfig:
    block_size: int | None = field(
        default=None,
        metadata=field_help("Tokens per KV cache block (a power of two, 1-256; default: 16 on CUDA, 64 on CPU)."),
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=field_help("Fraction of GPU memory the engine may use (weights + activations + KV cache)."),
    )
    swap_space: float = field(default=4.0, metadata=field_help("GiB of host memory for swapped-out KV blocks."))
    kv_cache_memory: float = field(
        default=1.0, metadata=field_help("GiB of KV cache on CPU (ignored on CUDA, where it is profiled).")
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=field_help(
            "KV cache element format: auto (the model's dtype), fp8 (= fp8_e4m3) or fp8_e5m2 with per-tensor"
            " scales (the checkpoint's k_scale/v_scale, else 1.0), int8 with a scale per token and head.",
            choices=KV_CACHE_DTYPES,
        ),
    )
    num_gpu_blocks_override: int | None = field(
        default=None, metadata=field_help("Use exactly this many device KV blocks (default: sized from memory).")
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=field_help("Reuse KV blocks of prompts that share a prefix.")
    )
    kv_reservation: str = field(
        default="paged",
        metadata=field_help(
            "Benchmarks only: paged, or reserve at admission as the paper's Orca baselines do"
            " (max = max_model_len, pow2 = next power of two of prompt + output, oracle = prompt + output).",
            choices=KV_RESERVATIONS,
            benchmark_only=True,
        ),
    )
    kv_events_config: KVEventsConfig | None = field(
        default=None,
        metadata=field_help(
            "Publish KV-cache events for prefix-aware routers, as vLLM's JSON, e.g. "
            """{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "kv@POD@MODEL"}"""
            " (default: off).",
            flag_type=str,  # NOTE: the text goes to the config, whose errors name the key at fault
        ),
    )

    def __post_init__(self) -> None:
        if self.kv_events_config is not None:
            # NOTE: LLM(kv_events_config=...) may give the JSON text or a dict, as the flag does.
            object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        if self.block_size is not None and not (
            isinstance(self.block_size, int)
            and 1 <= self.block_size <= 256
            and self.block_size & (self.block_size - 1) == 0
        ):
            raise ConfigError("block_size", self.block_size, "must be a power of two from 1 to 256")
        check_range("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        check_range("swap_space", self.swap_space, 0)
        check_range("kv_cache_memory", self.kv_cache_memory, 0.0, low_open=True)
        check_range("num_gpu_blocks_override", self.num_gpu_blocks_override, 1)
        check_choice("kv_reservation", self.kv_reservation, KV_RESERVATIONS)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.kv_events_enabled and not self.enable_prefix_caching:
            raise ConfigError(
                "kv_events_config",
                self.kv_events_config,
                "turn prefix caching on (--enable-prefix-caching) or the events off",
                problem="needs prefix caching: only cached blocks have events",
                subject="{name}",
            )

    @property
    def tokens_per_block(self) -> int:
        """``block_size`` once the engine has resolved it for its device (:func:`with_block_size`)."""
        if self.block_size is None:
            raise RuntimeError("the block size depends on the device: resolve it with with_block_size() first")
        return self.block_size

    def with_block_size(self, device_type: str) -> CacheConfig:
        """This config with ``block_size`` resolved for ``device_type`` (an explicit one is kept)."""
        if self.block_size is not None:
            return self
        check_choice("device", device_type, [d for d in DEVICES if d != "auto"])
        return dataclasses.replace(self, block_size=DEFAULT_BLOCK_SIZES[device_type])

    @property
    def kv_events_enabled(self) -> bool:
        """Whether the engine records prefix-cache events and publishes them."""
        return self.kv_events_config is not None and self.kv_events_config.enabled
