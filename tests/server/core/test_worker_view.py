"""The id-keyed step contract: a sequence goes to the workers whole once, then as diffs.

Each test drives a real scheduler and block manager and reads the frozen
:class:`SchedulerOutput` the scheduler's :class:`WorkerView` makes of each step.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from pagedllm.server.config import SchedulerConfig
from pagedllm.server.core.block_manager import BlockManager
from pagedllm.server.core.scheduler import ScheduledStep, Scheduler
from pagedllm.server.core.scheduler_output import CachedSeqs, NewSeqData, SchedulerOutput
from pagedllm.server.core.sequence import Sequence, SequenceGroup
from pagedllm.server.core.worker_view import split_step
from pagedllm.server.sampling_params import SamplingParams


def make(num_blocks: int = 16, block_size: int = 4, **config) -> Scheduler:
    bm = BlockManager(block_size, num_blocks, num_blocks, watermark=0.0)
    return Scheduler(SchedulerConfig(**{"max_num_batched_tokens": 64, **config}), bm)


def add(sched: Scheduler, request_id: str, seq_id: int, num_tokens: int, **params) -> SequenceGroup:
    group = SequenceGroup(request_id, [Sequence(seq_id, list(range(100, 100 + num_tokens)))], SamplingParams(**params))
    group.arrival_time = float(seq_id)
    sched.add(group)
    return group


def emit(sched: Scheduler) -> tuple[ScheduledStep, SchedulerOutput]:
    out = sched.schedule()
    return out, sched.worker_view.emit(out, split_step(out))


def finish_step(sched: Scheduler, out: ScheduledStep, token: int = 7) -> None:
    """The model ran: chunks computed, a token appended where a sequence reached its end."""
    ended = [
        seq
        for item in out.scheduled
        for seq in item.group.seqs
        if seq.seq_id in item.chunks and seq.num_computed_tokens + item.chunks[seq.seq_id] == len(seq)
    ]
    sched.mark_computed(out)
    for seq in ended:
        seq.append_token(token, 0.0, None)


def test_a_sequence_is_sent_whole_once_then_as_diffs():
    sched = make()
    add(sched, "a", 1, 3)
    out, plan = emit(sched)
    table = tuple(sched.block_manager.tables[1])
    assert plan.new_seqs == (NewSeqData(1, (100, 101, 102), table, 0),)
    assert plan.cached_seqs == CachedSeqs()
    assert plan.scheduled_seq_ids == (1,) and plan.num_scheduled_tokens == (3,)
    assert (plan.num_decodes, plan.num_verifies) == (0, 0) and plan.sample_seq_ids == ()
    finish_step(sched, out, token=7)
    out, plan = emit(sched)  # position 3: still the first block
    assert plan.new_seqs == ()
    assert plan.cached_seqs == CachedSeqs((1,), ((7,),), ((),), (False,), (3,))
    assert plan.num_decodes == 1 and plan.num_scheduled_tokens == (1,)
    finish_step(sched, out, token=8)
    out, plan = emit(sched)  # position 4 opens a second block: only that block id travels
    new_block = sched.block_manager.tables[1][-1]
    assert len(sched.block_manager.tables[1]) == 2
    assert plan.cached_seqs == CachedSeqs((1,), ((8,),), ((new_block,),), (False,), (4,))


def test_a_table_rebuilt_by_copy_on_write_is_sent_whole():
    sched = make()
    group = add(sched, "a", 1, 6, n=2, best_of=2, temperature=1.0)
    out, _ = emit(sched)
    finish_step(sched, out)
    parent = group.seqs[0]
    child = parent.fork(2)  # NOTE: as the sampler's second sample does; shares every block
    sched.block_manager.fork(parent, child)
    group.seqs.append(child)
    out, plan = emit(sched)
    assert out.blocks_to_copy, "the shared last block was copied on write"
    assert [s.seq_id for s in plan.new_seqs] == [2]
    assert plan.new_seqs[0].block_ids == tuple(sched.block_manager.tables[2])
    # NOTE: the parent appends first, so it copies the shared block: its table was rebuilt
    assert plan.cached_seqs.seq_ids == (1,) and plan.cached_seqs.replaced == (True,)
    assert plan.cached_seqs.new_block_ids == (tuple(sched.block_manager.tables[1]),)
    assert out.blocks_to_copy[0][1] == sched.block_manager.tables[1][-1]


def test_finished_and_recomputed_sequences_are_dropped_then_sent_again():
    sched = make(num_blocks=4, block_size=4, max_num_seqs=4, preemption_mode="recompute")
    add(sched, "a", 1, 5)
    add(sched, "b", 2, 5)
    out, plan = emit(sched)
    assert {s.seq_id for s in plan.new_seqs} == {1, 2}
    finish_step(sched, out)
    steps = 0
    while not any(plan.finished_seq_ids) and steps < 10:  # the cache fills: the later arrival is recomputed
        out, plan = emit(sched)
        finish_step(sched, out)
        steps += 1
    assert plan.finished_seq_ids == (2,) and 2 not in sched.worker_view
    sched.abort(["a"])
    for _ in range(3):
        out, plan = emit(sched)
        if plan.new_seqs:
            break
        finish_step(sched, out)
    assert 1 in plan.finished_seq_ids or 1 not in sched.worker_view
    assert [s.seq_id for s in plan.new_seqs] == [2] and plan.new_seqs[0].num_computed_tokens == 0


def test_a_swapped_group_comes_back_with_its_new_tables():
    sched = make(num_blocks=6, block_size=2, max_num_seqs=4)
    add(sched, "other", 1, 3)
    group = add(sched, "beam", 5, 3, n=2, best_of=2, temperature=1.0)  # NOTE: the later arrival is preempted
    out, _ = emit(sched)
    finish_step(sched, out)
    child = group.seqs[0].fork(6)
    sched.block_manager.fork(group.seqs[0], child)
    group.seqs.append(child)
    events = []
    for _ in range(20):
        out, plan = emit(sched)
        if out.blocks_to_swap_out:
            events.append("out")
            sched.abort(["other"])  # NOTE: room for the group to come back
        if out.blocks_to_swap_in:
            events.append("in")
            break
        finish_step(sched, out)
    assert events == ["out", "in"]
    cached = plan.cached_seqs
    assert set(cached.seq_ids) == {5, 6}
    for i, seq_id in enumerate(cached.seq_ids):
        assert cached.replaced[i] and cached.new_block_ids[i] == tuple(sched.block_manager.tables[seq_id])


def test_after_a_failed_step_the_workers_are_reset_and_get_everything_again():
    sched = make()
    add(sched, "a", 1, 4)
    add(sched, "b", 2, 4)
    out, plan = emit(sched)
    finish_step(sched, out)
    sched.worker_view.forget_all()
    out, plan = emit(sched)
    assert plan.reset and {s.seq_id for s in plan.new_seqs} == {1, 2} and plan.cached_seqs == CachedSeqs()
    assert plan.new_seqs[0].token_ids[-1] == 7 and plan.new_seqs[0].num_computed_tokens == 4
    finish_step(sched, out)
    _, plan = emit(sched)
    assert not plan.reset and not plan.new_seqs


def test_the_output_is_frozen_and_travels_without_the_sampling_to_other_ranks():
    sched = make()
    add(sched, "a", 1, 4)
    _, plan = emit(sched)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.reset = True  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.new_seqs[0].num_computed_tokens = 3  # type: ignore[misc]
    driver = plan.with_sampling("the driver's sampling batch")  # type: ignore[arg-type]
    other = driver.for_other_ranks()
    assert other.sampling is None and driver.sampling is not None and other.new_seqs == plan.new_seqs
    assert pickle.loads(pickle.dumps(other)) == other
    assert all(isinstance(v, tuple) for v in (plan.new_seqs, plan.scheduled_seq_ids, plan.finished_seq_ids))


def test_an_aborted_request_is_listed_once():
    sched = make()
    add(sched, "a", 1, 4)
    add(sched, "b", 2, 4)
    out, _ = emit(sched)
    finish_step(sched, out)
    sched.abort(["b"])
    out, plan = emit(sched)
    assert plan.finished_seq_ids == (2,) and plan.scheduled_seq_ids == (1,)
    finish_step(sched, out)
    _, plan = emit(sched)
    assert plan.finished_seq_ids == ()
