"""The scheduler applies a step's decisions: tokens, verdicts, proposals, forks, drops, hypotheses."""

from __future__ import annotations

import dataclasses

import pytest

from pagedllm.server.config import SchedulerConfig
from pagedllm.server.core.block_manager import BlockManager
from pagedllm.server.core.scheduler import ScheduledStep, Scheduler
from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.core.sequence_updates import GroupUpdate, NewSeq, SeqUpdate, StepUpdates
from pagedllm.server.outputs import Logprob
from pagedllm.server.sampling_params import SamplingParams

BLOCK = 4


def admitted(*prompts: list[int], best_of: int = 1) -> tuple[Scheduler, list[SequenceGroup], ScheduledStep]:
    """A scheduler with one request per prompt (request i, sequence i), all scheduled for their prefill."""
    bm = BlockManager(BLOCK, 16, 0)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    groups = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(n=best_of, temperature=1.0)
        groups.append(SequenceGroup(str(i), [Sequence(i, list(prompt))], params, arrival_time=float(i)))
        scheduler.add(groups[-1])
    return scheduler, groups, scheduler.schedule()


def test_a_token_update_appends_records_and_finishes_and_the_group_is_freed():
    scheduler, (group,), out = admitted([1, 2, 3, 4, 5])
    seq, bm = group.seqs[0], scheduler.block_manager
    top = {9: Logprob(-0.5, 1)}
    update = SeqUpdate(0, (9,), (-0.5,), (top,), "nine", (4, 6), SequenceStatus.FINISHED_STOPPED, 9)
    failed: dict[str, str] = {}
    done = scheduler.update_from_output(out, StepUpdates((GroupUpdate("0", updates=(update,)),), ("0",), 7.0), failed)
    assert done == [group] and failed == {} and not scheduler.has_unfinished()
    assert seq.num_computed_tokens == 5 and seq.token_ids == [1, 2, 3, 4, 5, 9] and seq.output_logprobs == [top]
    assert (
        seq.cumulative_logprob == -0.5 and seq.output_text == "nine" and (seq.prefix_offset, seq.read_offset) == (4, 6)
    )
    assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.stop_reason == 9
    assert group.first_token_time == 7.0 and bm.tables == {} and bm.gpu.num_free == 16


def test_a_failed_model_step_only_aborts_its_requests():
    scheduler, (group,), out = admitted([1, 2, 3])
    done = scheduler.update_from_output(out, None, {"0": "the model step failed"})
    assert done == [] and not scheduler.has_unfinished()
    assert group.seqs[0].num_computed_tokens == 0 and group.seqs[0].status is SequenceStatus.FINISHED_ABORTED
    assert scheduler.block_manager.tables == {}


def test_an_update_that_fails_fails_its_request_alone():
    scheduler, (a, b), out = admitted([1, 2, 3], [4, 5, 6])
    broken = GroupUpdate("0", updates=(SeqUpdate(42, (7,), (None,)),))  # no such sequence
    fine = GroupUpdate("1", updates=(SeqUpdate(1, (7,), (None,)),))
    failed: dict[str, str] = {}
    scheduler.update_from_output(out, StepUpdates((broken, fine)), failed)
    assert list(failed) == ["0"] and "42" in failed["0"]
    assert a.seqs[0].status is SequenceStatus.FINISHED_ABORTED and a.seqs[0].output_token_ids == []
    assert b.seqs[0].output_token_ids == [7] and b.seqs[0].cumulative_logprob is None
    assert scheduler.running == [b]


def test_forks_copy_the_parent_before_its_token_and_share_its_blocks():
    scheduler, (group,), out = admitted([1, 2, 3, 4, 5, 6], best_of=3)
    bm = scheduler.block_manager
    forks = (NewSeq(0, 10), NewSeq(0, 11))
    updates = tuple(SeqUpdate(seq_id, (token,), (-1.0,)) for seq_id, token in ((10, 7), (11, 8), (0, 9)))
    step = StepUpdates((GroupUpdate("0", new_seqs=forks, updates=updates, seqs=(0, 10, 11)),))
    scheduler.update_from_output(out, step, {})
    assert [s.seq_id for s in group.seqs] == [0, 10, 11]
    assert [s.output_token_ids for s in group.seqs] == [[9], [7], [8]]
    assert all(s.num_computed_tokens == 6 and s.cumulative_logprob == -1.0 for s in group.seqs)
    assert bm.tables[10] == bm.tables[11] == bm.tables[0] and bm.gpu.ref_counts[:2] == [3, 3]
    scheduler.update_from_output(scheduler.schedule(), StepUpdates((GroupUpdate("0", drops=(10, 11), seqs=(0,)),)), {})
    assert [s.seq_id for s in group.seqs] == [0] and sorted(bm.tables) == [0] and bm.check_invariants() == []


def test_beam_hypotheses_are_block_less_copies_that_the_group_keeps():
    scheduler, (group,), out = admitted([1, 2, 3, 4, 5], best_of=2)
    bm = scheduler.block_manager
    hyp = SeqUpdate(20, (2,), (-0.25,), finish=SequenceStatus.FINISHED_LENGTH)
    beam = SeqUpdate(0, (3,), (-0.5,))
    first = GroupUpdate(
        "0", new_seqs=(NewSeq(0, 20, shares_blocks=False),), updates=(hyp, beam), hypotheses=(20,), seqs=(0,)
    )
    scheduler.update_from_output(out, StepUpdates((first,)), {})
    (kept,) = group.hypotheses
    assert kept.seq_id == 20 and kept.output_token_ids == [2] and kept.status is SequenceStatus.FINISHED_LENGTH
    assert group.seqs[0].output_token_ids == [3]  # the hypothesis was copied before the beam's token
    assert 20 not in bm.tables and [s.seq_id for s in group.seqs] == [0]
    done = GroupUpdate("0", drops=(0,), hypotheses=(20,), seqs=(20,))  # the search ends on its hypotheses
    assert scheduler.update_from_output(scheduler.schedule(), StepUpdates((done,)), {}) == [group]
    assert group.seqs == [kept] and bm.tables == {} and bm.gpu.num_free == 16


def test_verified_proposals_are_cleared_and_the_accepted_ones_counted():
    scheduler, (group,), out = admitted([1, 2, 3, 4, 5, 6, 7])
    seq, bm = group.seqs[0], scheduler.block_manager
    scheduler.update_from_output(out, StepUpdates((GroupUpdate("0", updates=(SeqUpdate(0, (8,), (None,)),)),)), {})
    scheduler.set_proposals({0: [9, 10, 11], 5: [1]})  # NOTE: an unknown sequence's proposals are ignored
    assert seq.spec_token_ids == [9, 10, 11]
    out = scheduler.schedule()
    assert out.scheduled[0].chunks == {0: 4} and len(bm.tables[0]) == 3  # 8 tokens + 3 proposals
    verdict = SeqUpdate(0, (9, 12), (None, None), verified=True, num_accepted=1)
    scheduler.update_from_output(out, StepUpdates((GroupUpdate("0", updates=(verdict,)),)), {})
    assert seq.token_ids[-3:] == [8, 9, 12] and seq.num_computed_tokens == 9 and seq.spec_token_ids == []
    assert len(bm.tables[0]) == 3 and bm.check_invariants() == []  # 10 tokens: the third block stays


def test_decisions_are_frozen():
    update = SeqUpdate(0, (1,), (None,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        update.finish = SequenceStatus.FINISHED_STOPPED  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        GroupUpdate("r").seqs = (0,)  # type: ignore[misc]


def test_tokens_without_logprobs_are_appended_all_the_same():
    scheduler, (group,), out = admitted([1, 2, 3])
    scheduler.update_from_output(out, StepUpdates((GroupUpdate("0", updates=(SeqUpdate(0, (4,)),)),)), {})
    assert group.seqs[0].output_token_ids == [4] and group.seqs[0].cumulative_logprob is None


def test_a_single_sequence_update_naming_another_sequence_fails_that_request_alone():
    scheduler, (group, other), out = admitted([1, 2, 3], [4, 5, 6])
    bad = GroupUpdate("0", updates=(SeqUpdate(7, (9,)),))
    good = GroupUpdate("1", updates=(SeqUpdate(1, (8,)),))
    failed: dict[str, str] = {}
    scheduler.update_from_output(out, StepUpdates((bad, good), (), 1.0), failed)
    assert list(failed) == ["0"] and "KeyError(7)" in failed["0"]
    assert group.seqs[0].output_token_ids == [] and other.seqs[0].output_token_ids == [8]


def test_a_single_sequence_update_that_drops_its_sequence_frees_its_blocks():
    scheduler, (group,), out = admitted([1, 2, 3, 4, 5])
    bm = scheduler.block_manager
    assert bm.tables
    update = GroupUpdate("0", updates=(SeqUpdate(0, (9,)),), drops=(0,))
    scheduler.update_from_output(out, StepUpdates((update,), (), 1.0), {})
    assert group.seqs[0].token_ids == [1, 2, 3, 4, 5, 9] and bm.tables == {}
