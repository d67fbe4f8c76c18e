"""The LoRA adapters an engine knows, by id: checked against the model once, forgotten on request.

Residency (which adapter sits in which slot) is :class:`~pagedllm.server.core.lora_slots.LoRASlots`'s;
this registry only says which ids name which adapters, and reports them for ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedllm.server.config import ConfigError
from pagedllm.server.core.lora_slots import LoRASlots
from pagedllm.server.core.sequence import SequenceGroup
from pagedllm.server.lora_request import LoRARequest


class LoRARegistry:
    """``model_lora`` checks an adapter's config and shapes (None: LoRA is off); ``slots`` holds residents."""

    def __init__(self, model_lora: Any, slots: LoRASlots | None) -> None:
        self.model_lora = model_lora
        self.slots = slots
        self._known: dict[int, LoRARequest] = {}

    def add(self, lora_request: LoRARequest | None) -> None:
        """Check an adapter against the model (config and tensor shapes) once per id; :class:`ConfigError` if it
        does not fit, LoRA is off, or its id already names another adapter. Its weights load when a step needs them.
        """
        if lora_request is None:
            return
        if self.model_lora is None:
            raise ConfigError(
                "lora_request",
                lora_request.lora_name,
                "start the engine with enable_lora=True (--enable-lora)",
                problem="needs LoRA, which is off",
                subject=f"LoRA adapter {lora_request.lora_name!r}",
            )
        known = self._known.get(lora_request.lora_int_id)
        if known == lora_request:
            return
        if known is not None:
            raise ConfigError(
                "lora_request",
                lora_request.lora_int_id,
                f"give each adapter its own id (it names {known.lora_name!r} at {known.lora_path})",
                problem="is already in use",
                subject=f"lora_int_id={lora_request.lora_int_id}",
            )
        self.model_lora.check(lora_request)
        self._known[lora_request.lora_int_id] = lora_request

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot is freed for others); False (nothing done) while requests use it."""
        if self.slots is not None and not self.slots.forget(lora_int_id):
            return False
        self._known.pop(lora_int_id, None)
        return True

    def stats(self, waiting: Iterable[SequenceGroup]) -> dict:
        """``EngineStats`` fields: adapters of running and of ``waiting`` requests, and the slot count."""
        if self.slots is None:
            return {}
        names = {g.lora_request.lora_name for g in waiting if g.lora_request is not None}
        return dict(
            running_lora_adapters=tuple(self.slots.running_names),
            waiting_lora_adapters=tuple(sorted(names)),
            max_lora=self.slots.max_loras,
        )
