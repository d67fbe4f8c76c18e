"""Reservation-based allocation (the paper's Orca baselines): exact block counts in the block manager."""

from __future__ import annotations

import pytest

from pagedllm.server.config import ConfigError, EngineConfig, engine_fields
from pagedllm.server.core.block_manager import AllocStatus, BlockManager
from pagedllm.server.core.kv_reservation import KVReservation
from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.sampling_params import SamplingParams

BLOCK = 4
MAX_LEN = 64  # 16 blocks


def make_manager(mode: str, num_gpu: int = 40) -> BlockManager:
    reservation = KVReservation(mode, BLOCK, MAX_LEN) if mode != "paged" else None
    return BlockManager(BLOCK, num_gpu, 0, watermark=0.0, reservation=reservation)


def admit(bm: BlockManager, seq_id: int, prompt: int, output: int) -> Sequence:
    seq = Sequence(seq_id, list(range(prompt)))
    if bm.reservation:
        bm.reservation.expect(seq_id, prompt + output)
    group = SequenceGroup(str(seq_id), [seq], SamplingParams(max_tokens=max(output, 1)))
    assert bm.can_allocate(group) == AllocStatus.OK
    seq.num_computed_tokens = bm.allocate(seq)
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = prompt
    return seq


def grow(bm: BlockManager, seq: Sequence, tokens: int) -> None:
    for _ in range(tokens):
        seq.append_token(1, 0.0, None)
        bm.append_slots(seq)
        seq.num_computed_tokens += 1


@pytest.mark.parametrize(
    ("mode", "prompt", "output", "blocks"),
    [
        ("paged", 5, 10, 2),  # only the prompt's blocks: ceil(5 / 4)
        ("oracle", 5, 10, 4),  # ceil(15 / 4)
        ("pow2", 5, 10, 4),  # 16 tokens
        ("pow2", 5, 12, 8),  # 17 -> 32 tokens
        ("max", 5, 10, 16),  # max_model_len = 64 tokens
        ("pow2", 40, 40, 16),  # 80 -> 128, capped at max_model_len
    ],
)
def test_admission_holds_the_reservation(mode, prompt, output, blocks):
    bm = make_manager(mode)
    seq = admit(bm, 0, prompt, output)
    assert len(bm.block_table(seq)) == -(-prompt // BLOCK)
    assert len(bm.block_table(seq)) + bm.reserved_blocks(seq) == blocks
    assert bm.num_available == 40 - blocks


def test_growth_draws_the_promise_down_and_free_returns_it():
    bm = make_manager("oracle")
    seq = admit(bm, 0, 5, 10)  # 2 blocks allocated, 2 promised
    grow(bm, seq, 4)  # 9 tokens: a third block
    assert (len(bm.block_table(seq)), bm.reserved_blocks(seq), bm.num_available) == (3, 1, 36)
    grow(bm, seq, 6)  # 15 tokens: the fourth and last block
    assert (len(bm.block_table(seq)), bm.reserved_blocks(seq), bm.num_available) == (4, 0, 36)
    seq.status = SequenceStatus.FINISHED_LENGTH
    bm.free(seq)
    assert bm.num_available == 40 and bm.reservation.outstanding == 0
    assert bm.check_invariants() == []


def test_reservations_limit_admission_where_paging_admits():
    """Sixteen blocks: paging admits all five 5+10-token requests, Oracle four, Max one."""
    admitted = {}
    for mode in ("paged", "oracle", "max"):
        bm = make_manager(mode, num_gpu=16)
        count = 0
        for i in range(5):
            seq = Sequence(i, list(range(5)))
            if bm.reservation:
                bm.reservation.expect(i, 15)
            group = SequenceGroup(str(i), [seq], SamplingParams(max_tokens=10))
            if bm.can_allocate(group) != AllocStatus.OK:
                break
            seq.num_computed_tokens = bm.allocate(seq)
            count += 1
        admitted[mode] = count
    assert admitted == {"paged": 5, "oracle": 4, "max": 1}


def test_a_reserved_sequence_appends_even_when_others_took_every_free_block():
    bm = make_manager("oracle", num_gpu=8)
    first = admit(bm, 0, 4, 12)  # 1 allocated + 3 promised
    other = admit(bm, 1, 16, 0)  # the 4 other blocks
    assert bm.num_available == 0
    other.append_token(1, 0.0, None)
    assert not bm.can_append_slots([other])  # no room past its own
    for _ in range(12):
        assert bm.can_append_slots([first])
        grow(bm, first, 1)
    assert len(bm.block_table(first)) == 4 and bm.gpu.num_free == 0


def test_preemption_returns_the_promise_and_keeps_the_expected_length():
    bm = make_manager("max")
    seq = admit(bm, 0, 5, 10)
    bm.free(seq)  # preempted for recompute: still running, not finished
    assert bm.reservation.outstanding == 0
    assert bm.reservation.blocks(0) == 16


def test_the_option_is_for_benchmarks_only():
    assert "kv_reservation" not in {f.name for f in engine_fields()}
    assert EngineConfig.from_kwargs(kv_reservation="pow2").cache.kv_reservation == "pow2"
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_kwargs(kv_reservation="buddy")
    assert info.value.field == "kv_reservation"
