"""Which LoRA adapter sits in which of the ``max_loras`` slots, and who is using it.

A request with an adapter holds the adapter's slot from its admission until it finishes,
is aborted or is preempted back to the waiting queue. An adapter no request holds stays
resident (a later request finds its weights loaded) until its slot is wanted by another
adapter; then the least recently released idle adapter is evicted::

    slots  1: sql (2 users)   2: chat (idle, released at t=5)   3: math (idle, t=9)
    admit "poetry": no free slot -> evict chat (the oldest idle) -> poetry takes slot 2
    admit "code" while every slot has users -> wait (the scheduler stops admitting)

Slot 0 is the base model's and is never handed out. Pure bookkeeping: the worker loads
an adapter into its slot when a step first uses it there.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedllm.server.lora_request import LoRARequest


class LoRASlots:
    """Slots 1..max_loras: resident adapters, their users, and LRU eviction of idle ones."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.slot_of: dict[int, int] = {}
        """Adapter id -> its slot, for every resident adapter."""
        self.names: dict[int, str] = {}
        self.users: dict[int, int] = {}
        """Adapter id -> requests holding it (only ids with at least one)."""
        self._idle: OrderedDict[int, None] = OrderedDict()  # NOTE: resident, no users; oldest release first
        self._free = list(range(max_loras, 0, -1))
        self._holders: dict[str, int] = {}  # request id -> the adapter id it holds

    def can_acquire(self, lora: LoRARequest | None) -> bool:
        """Whether a request with ``lora`` can be admitted now (resident, a free slot, or an idle one to evict)."""
        return lora is None or lora.lora_int_id in self.slot_of or bool(self._free) or bool(self._idle)

    def acquire(self, request_id: str, lora: LoRARequest | None) -> None:
        """Request ``request_id`` holds ``lora``'s slot (placing the adapter, evicting an idle one if needed)."""
        if lora is None or request_id in self._holders:
            return
        lora_id = lora.lora_int_id
        if lora_id not in self.slot_of:
            if not self._free:
                if not self._idle:
                    raise RuntimeError(f"no slot for LoRA adapter {lora.lora_name!r}: check can_acquire() first")
                evicted, _ = self._idle.popitem(last=False)
                self._free.append(self.slot_of.pop(evicted))
                self.names.pop(evicted, None)
            self.slot_of[lora_id] = self._free.pop()
            self.names[lora_id] = lora.lora_name
        self._idle.pop(lora_id, None)
        self.users[lora_id] = self.users.get(lora_id, 0) + 1
        self._holders[request_id] = lora_id

    def release(self, request_id: str) -> None:
        """Request ``request_id`` stops holding its adapter (idempotent); with no users left it becomes evictable."""
        lora_id = self._holders.pop(request_id, None)
        if lora_id is None:
            return
        left = self.users[lora_id] - 1
        if left > 0:
            self.users[lora_id] = left
            return
        del self.users[lora_id]
        self._idle[lora_id] = None

    def forget(self, lora_id: int) -> bool:
        """Drop an idle adapter from its slot (it was unloaded); False while requests use it."""
        if lora_id in self.users:
            return False
        if lora_id in self.slot_of:
            self._idle.pop(lora_id, None)
            self._free.append(self.slot_of.pop(lora_id))
            self.names.pop(lora_id, None)
        return True

    @property
    def running_names(self) -> list[str]:
        """Names of the adapters requests hold now."""
        return sorted(self.names[i] for i in self.users if i in self.names)
