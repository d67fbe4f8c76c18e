"""The HTTP server's own options (the engine's are in :class:`EngineConfig`); torch-free for the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.server.config import ConfigError, check_choice
from pagedllm.server.entrypoints.openai.reasoning_parser import REASONING_PARSERS
from pagedllm.server.entrypoints.openai.tool_formats import TOOL_CALL_PARSERS

DEFAULT_MAX_BODY_BYTES = 8 << 20
CACHE_SALT_POLICIES = ("optional", "required", "api-key")
DEFAULT_RESPONSES_STORE_SIZE = 500
ENGINE_CORE_MODES = ("process", "thread")


@dataclass
class ServerSettings:
    """The server's own options (the engine's are in :class:`EngineConfig`)."""

    served_model_names: list[str] = field(default_factory=list)
    """Names clients use in ``model``; defaults to the model path (or ``pagedllm-demo``)."""
    api_key: str | None = None
    """When set, ``/v1/*`` requires ``Authorization: Bearer <api_key>``."""
    max_queue_len: int | None = None
    """Most requests waiting to be scheduled; more get 503 with Retry-After (default: 4 x max_num_seqs).

    NOTE: /ready stays 200 while the queue is full: overload is not ill health, and a
    replica taken out of its Service would only push its load onto the others."""
    request_timeout: float | None = None
    """Seconds a request may take in all; past that it is aborted (504, or an error event on a stream)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Largest request body accepted; larger ones get 413."""
    drain_timeout: float = 30.0
    """Seconds a SIGTERM waits for in-flight requests before aborting them."""
    chat_template: str | None = None
    """A Jinja chat template (text) replacing the tokenizer's."""
    warmup: bool = True
    """Run one forward pass before reporting ready."""
    log_requests: bool = True
    """One access-log line per request (id, status, tokens, latency)."""
    cache_salt_policy: str = "optional"
    """``optional``: requests may give a ``cache_salt``; ``required``: they must; ``api-key``: the salt is
    derived from the caller's bearer token (plus any salt given), so tenants never share prefix blocks."""
    lora_modules: dict[str, str] = field(default_factory=dict)
    """LoRA adapters served from the start: the name a request gives as ``model`` -> its PEFT directory."""
    allow_runtime_lora_updating: bool = False
    """Serve ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (``PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING``)."""
    responses_store_size: int = DEFAULT_RESPONSES_STORE_SIZE
    """Most ``/v1/responses`` answers kept in memory for ``previous_response_id`` (least recently used
    out first); 0 keeps none."""
    engine_core: str = "thread"
    """Where the engine runs: ``process`` (an engine-core process of its own, fed over ZMQ; what
    ``pagedllm serve`` uses) or ``thread`` (a thread of the server's process; the default for an app
    built in a Python program, e.g. tests, where ``engine.call`` may take any callable)."""

    tool_call_parser: str | None = None
    """The format ``tool_choice="auto"`` reads calls in (one of :data:`TOOL_CALL_PARSERS`); None: Hermes
    ``<tool_call>`` and LLaMA-3 JSON, both."""
    enable_auto_tool_choice: bool = False
    """vLLM's switch for ``tool_choice="auto"``; accepted for its command lines (auto is always served
    here), and, as there, it needs ``tool_call_parser``."""
    reasoning_parser: str | None = None
    """How the model marks its reasoning (one of :data:`REASONING_PARSERS`): chat answers carry it as
    ``reasoning_content``, apart from ``content``; None: the whole text is content."""

    def __post_init__(self) -> None:
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ConfigError(
                "request_timeout", self.request_timeout, "must be > 0 or unset", problem="is out of range"
            )
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes", self.max_body_bytes, "must be >= 1024", problem="is out of range")
        if self.max_queue_len is not None and self.max_queue_len < 1:
            raise ConfigError("max_queue_len", self.max_queue_len, "must be >= 1 or unset", problem="is out of range")
        if self.drain_timeout < 0:
            raise ConfigError("drain_timeout", self.drain_timeout, "must be >= 0", problem="is out of range")
        if self.api_key == "":
            raise ConfigError("api_key", self.api_key, "give a non-empty key or none")
        if self.responses_store_size < 0:
            raise ConfigError(
                "responses_store_size", self.responses_store_size, "must be >= 0", problem="is out of range"
            )
        check_choice("cache_salt_policy", self.cache_salt_policy, CACHE_SALT_POLICIES)
        check_choice("engine_core", self.engine_core, ENGINE_CORE_MODES)
        if self.tool_call_parser is not None:
            check_choice("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        if self.reasoning_parser is not None:
            check_choice("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError(
                "enable_auto_tool_choice",
                True,
                f"also give --tool-call-parser, one of {list(TOOL_CALL_PARSERS)}",
                problem="needs a tool-call parser",
            )
