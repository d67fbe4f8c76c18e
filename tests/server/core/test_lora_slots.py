"""LoRASlots: resident adapters, users, LRU eviction of idle adapters, and waiting when every slot is busy."""

from __future__ import annotations

import pytest

from pagedllm.server.core.lora_slots import LoRASlots
from pagedllm.server.lora_request import LoRARequest


def lora(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/a{i}")


def test_slots_are_handed_out_from_one_and_shared_by_users_of_one_adapter():
    slots = LoRASlots(2)
    slots.acquire("r1", lora(7))
    slots.acquire("r2", lora(7))
    slots.acquire("r3", lora(9))
    assert slots.slot_of == {7: 1, 9: 2}
    assert slots.users == {7: 2, 9: 1}
    assert slots.running_names == ["a7", "a9"]


def test_the_least_recently_released_idle_adapter_is_evicted():
    slots = LoRASlots(2)
    slots.acquire("r1", lora(1))
    slots.acquire("r2", lora(2))
    slots.release("r2")  # a2 idle first
    slots.release("r1")  # then a1
    slots.acquire("r3", lora(3))
    assert slots.slot_of == {1: 1, 3: 2}  # a2 was evicted, a3 took its slot
    slots.acquire("r4", lora(1))  # resident: no eviction, becomes busy again
    assert slots.slot_of == {1: 1, 3: 2}


def test_an_adapter_in_use_is_never_evicted_and_newcomers_wait():
    slots = LoRASlots(1)
    slots.acquire("r1", lora(1))
    assert not slots.can_acquire(lora(2))
    assert slots.can_acquire(lora(1)) and slots.can_acquire(None)
    with pytest.raises(RuntimeError, match="no slot for LoRA adapter 'a2'"):
        slots.acquire("r2", lora(2))
    slots.release("r1")
    assert slots.can_acquire(lora(2))


def test_release_is_idempotent_and_forget_refuses_adapters_in_use():
    slots = LoRASlots(1)
    slots.acquire("r1", lora(1))
    assert not slots.forget(1)
    slots.release("r1")
    slots.release("r1")
    assert slots.users == {}
    assert slots.forget(1)
    assert slots.slot_of == {} and slots.can_acquire(lora(2))
