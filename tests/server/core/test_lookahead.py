"""Scheduling one step ahead: placeholders, what may be followed ahead, and the fall back when room is short."""

from __future__ import annotations

from test_scheduler import make_scheduler

from pagedllm.server.core.lookahead import can_follow, follows, schedule_ahead, surely_ends
from pagedllm.server.core.scheduler_output import PLACEHOLDER_TOKEN_ID
from pagedllm.server.core.sequence import Sequence, SequenceGroup
from pagedllm.server.core.sequence_updates import GroupUpdate, SeqUpdate, StepUpdates
from pagedllm.server.sampling_params import SamplingParams


def request(request_id: str, seq_id: int, num_tokens: int, **params) -> SequenceGroup:
    sampling = SamplingParams(**{"temperature": 0.0, "max_tokens": 16, **params})
    return SequenceGroup(request_id, [Sequence(seq_id, list(range(1, num_tokens + 1)))], sampling, arrival_time=seq_id)


def samplers(out) -> list:
    return [(item.group, seq) for item in out.scheduled for seq in item.group.seqs]


def test_a_decode_is_scheduled_ahead_with_a_placeholder_then_gets_its_token():
    s = make_scheduler(num_blocks=16, block_size=4)
    group = request("a", 0, 4)
    s.add(group)
    first = s.schedule()  # the prompt: samples the first token
    seq = group.seqs[0]
    s.updater.advance(first)
    ahead, held = schedule_ahead(s, samplers(first), max_model_len=64)
    assert held == [seq] and seq.token_ids == [1, 2, 3, 4, PLACEHOLDER_TOKEN_ID] and seq.output_token_ids == []
    assert ahead.scheduled[0].chunks == {0: 1} and seq.num_computed_tokens == 4
    assert len(s.block_manager.tables[0]) == 2  # a block for the placeholder's position
    # the first step is processed: the placeholder goes, the sampled token takes its place
    s.updater.drop_placeholders(held)
    update = StepUpdates((GroupUpdate("a", updates=(SeqUpdate(0, (9,)),)),))
    s.update_from_output(first, update, {}, advanced=True)
    assert seq.token_ids == [1, 2, 3, 4, 9] and seq.num_computed_tokens == 4


def test_a_token_that_surely_ends_the_request_gets_no_placeholder():
    s = make_scheduler(num_blocks=16, block_size=4)
    last = request("last", 0, 4, max_tokens=1)
    s.add(last)
    first = s.schedule()
    assert surely_ends(last, last.seqs[0], max_model_len=64)
    s.updater.advance(first)
    ahead, held = schedule_ahead(s, samplers(first), max_model_len=64)
    assert held == [] and ahead.scheduled == []  # fully computed, nothing to schedule for it
    assert surely_ends(request("long", 1, 63), Sequence(1, list(range(63))), max_model_len=64)


def test_without_room_for_every_next_token_nothing_is_scheduled_ahead():
    s = make_scheduler(num_blocks=2, block_size=4)  # two prompts of a full block each: no room to grow
    for i in range(2):
        s.add(request(f"r{i}", i, 4))
    first = s.schedule()
    assert len(first.scheduled) == 2
    s.updater.advance(first)
    ahead, held = schedule_ahead(s, samplers(first), max_model_len=64)
    assert ahead is None and held == []
    assert all(not g.seqs[0].has_placeholder for g in s.running)  # the placeholders were taken back


def test_what_may_be_followed_ahead():
    assert follows(request("plain", 0, 3, logprobs=2, logit_bias={3: 1.0}))
    assert follows(request("seeded", 0, 3, seed=7))
    assert not follows(request("n2", 0, 3, n=2, temperature=0.8))
    assert not follows(request("best-of", 0, 3, best_of=2, temperature=0.8))
    assert not follows(request("penalty", 0, 3, repetition_penalty=1.1))
    assert not follows(request("presence", 0, 3, presence_penalty=0.5))
    assert not follows(request("prompt-logprobs", 0, 3, prompt_logprobs=1))
    assert not follows(request("min-tokens", 0, 3, min_tokens=2))  # banned ids change once it is met
    s = make_scheduler(num_blocks=16, block_size=4)
    s.add(request("a", 0, 3))
    s.add(request("b", 1, 3, repetition_penalty=1.2))
    out = s.schedule()
    assert not can_follow(out)
