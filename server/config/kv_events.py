"""KV-cache events for prefix-aware routers (vLLM's ``--kv-events-config``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.server.config.checks import ConfigError, check_choice, check_range, json_object

KV_EVENT_PUBLISHERS = ("null", "zmq")
KV_EVENT_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """KV-cache events for prefix-aware routers, given as vLLM's ``--kv-events-config`` JSON.

    An ``endpoint`` with ``*`` (``tcp://*:5557``), ``::``, or an ``ipc://`` / ``inproc://``
    one is bound and subscribers connect to it; any other (``tcp://router:5557``) is
    connected to a subscriber that binds, as in vLLM.
    """

    enable_kv_cache_events: bool = False
    """Record prefix-cache events (needs prefix caching)."""
    publisher: str | None = None
    """``zmq`` or ``null`` (nothing sent); default: zmq when enabled."""
    endpoint: str = "tcp://*:5557"
    """The ZeroMQ PUB socket's address."""
    replay_endpoint: str | None = None
    """A ROUTER address where a subscriber asks for recent batches again from a sequence number."""
    buffer_steps: int = 10_000
    """Batches (steps with events) kept for replay."""
    hwm: int = 100_000
    """ZeroMQ's high-water mark of the PUB socket: messages queued per subscriber before dropping."""
    max_queue_size: int = 100_000
    """Batches waiting for the publisher thread; when full the oldest is dropped (and counted)."""
    topic: str = ""
    """Sent as the first frame of every message; llm-d reads ``kv@<pod>@<model>``."""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        check_choice("kv_events_config.publisher", self.publisher, KV_EVENT_PUBLISHERS)
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.startswith(KV_EVENT_ENDPOINT_SCHEMES)):
                raise ConfigError(
                    f"kv_events_config.{name}",
                    value,
                    f"a ZeroMQ address starting with one of {list(KV_EVENT_ENDPOINT_SCHEMES)}",
                )
        check_range("kv_events_config.buffer_steps", self.buffer_steps, 0)
        check_range("kv_events_config.hwm", self.hwm, 0)
        check_range("kv_events_config.max_queue_size", self.max_queue_size, 1)

    @property
    def enabled(self) -> bool:
        """Events are recorded and sent."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value: str | dict[str, Any] | KVEventsConfig) -> KVEventsConfig:
        """From the JSON text of the flag, a dict of its keys, or an instance; errors name the key at fault."""
        if isinstance(value, KVEventsConfig):
            return value
        return cls(**json_object("kv_events_config", value, cls))
