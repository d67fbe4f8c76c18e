"""Engine configuration: frozen dataclasses validated once, at the edge.

Every engine argument is a field of exactly one of the sub-configs (one module each:
``model``, ``cache``, ``scheduler``, ``parallel``, ``lora``; ``kv_events`` and
``speculative`` for the JSON-valued flags), combined into :class:`EngineConfig`. The
``LLM(...)`` keyword arguments, the ``pagedllm`` CLI flags (``--block-size`` for
``block_size``) and the operator's rendered command line are all derived from these
fields (see :mod:`pagedllm.server.args`), so there is one source of truth.

Every name is importable from here (``from pagedllm.server.config import EngineConfig``).
"""

from pagedllm.server.config.cache import DEFAULT_BLOCK_SIZES, KV_CACHE_DTYPES, KV_RESERVATIONS, CacheConfig, GiB
from pagedllm.server.config.checks import ConfigError, check_choice, check_range, field_help, json_object
from pagedllm.server.config.engine import SUB_CONFIGS, EngineConfig, engine_fields
from pagedllm.server.config.kv_events import KV_EVENT_ENDPOINT_SCHEMES, KV_EVENT_PUBLISHERS, KVEventsConfig
from pagedllm.server.config.lora import MAX_LORA_RANKS, LoRAConfig
from pagedllm.server.config.model import (
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    LOAD_FORMATS,
    POOLING_TYPES,
    ModelConfig,
)
from pagedllm.server.config.parallel import ParallelConfig
from pagedllm.server.config.scheduler import (
    DEFAULT_PREFILL_WHILE_DECODING,
    DEFAULT_TOKEN_BUDGETS,
    PREEMPTION_MODES,
    SchedulerConfig,
    TokenBudget,
    choose_token_budget,
)
from pagedllm.server.config.speculative import (
    DEFAULT_PROMPT_LOOKUP,
    MAX_SPECULATIVE_TOKENS,
    SPEC_METHODS,
    SpeculativeConfig,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "DEFAULT_BLOCK_SIZES",
    "DEFAULT_PREFILL_WHILE_DECODING",
    "DEFAULT_PROMPT_LOOKUP",
    "DEFAULT_TOKEN_BUDGETS",
    "DEVICES",
    "DTYPES",
    "KV_EVENT_ENDPOINT_SCHEMES",
    "KV_EVENT_PUBLISHERS",
    "KV_CACHE_DTYPES",
    "KV_RESERVATIONS",
    "LOAD_FORMATS",
    "MAX_LORA_RANKS",
    "MAX_SPECULATIVE_TOKENS",
    "POOLING_TYPES",
    "PREEMPTION_MODES",
    "SPEC_METHODS",
    "SUB_CONFIGS",
    "CacheConfig",
    "ConfigError",
    "EngineConfig",
    "GiB",
    "KVEventsConfig",
    "LoRAConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "TokenBudget",
    "check_choice",
    "check_range",
    "choose_token_budget",
    "engine_fields",
    "field_help",
    "json_object",
]
