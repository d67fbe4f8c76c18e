"""The engine's whole configuration, combined from the sub-configs, and the arguments it takes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pagedllm.server.config.cache import CacheConfig
from pagedllm.server.config.checks import ConfigError
from pagedllm.server.config.lora import LoRAConfig
from pagedllm.server.config.model import ModelConfig
from pagedllm.server.config.parallel import ParallelConfig
from pagedllm.server.config.scheduler import SchedulerConfig

SUB_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoRAConfig)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, combined from the sub-configs."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.scheduler.async_scheduling and self.parallel.tensor_parallel_size > 1:
            # NOTE: the other ranks would need the driver's sampled ids to fill in the scheduled-ahead tokens
            raise ConfigError(
                "async_scheduling",
                True,
                "off with tensor_parallel_size > 1 (only one rank is supported)",
                problem="is not supported",
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Route flat engine arguments (``block_size=16, ...``) to their sub-config."""
        known = {f.name: sub for sub in SUB_CONFIGS for f in dataclasses.fields(sub)}
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise ConfigError(
                unknown[0], kwargs[unknown[0]], f"allowed are {sorted(known)}", problem="is an unknown engine argument"
            )
        parts: dict[type, dict[str, Any]] = {sub: {} for sub in SUB_CONFIGS}
        for name, value in kwargs.items():
            parts[known[name]][name] = value
        return cls(
            ModelConfig(**parts[ModelConfig]),
            CacheConfig(**parts[CacheConfig]),
            SchedulerConfig(**parts[SchedulerConfig]),
            ParallelConfig(**parts[ParallelConfig]),
            LoRAConfig(**parts[LoRAConfig]),
        )


def engine_fields() -> list[dataclasses.Field]:
    """The engine arguments a deployment sets (CLI flags, the CRD), in declaration order.

    NOTE: fields marked ``benchmark_only`` are left out: ``LLM(...)`` accepts them, a server does not.
    """
    return [f for sub in SUB_CONFIGS for f in dataclasses.fields(sub) if not f.metadata.get("benchmark_only")]
