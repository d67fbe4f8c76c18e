"""Scheduler: FCFS admission, chunked prefill beside decodes, preemption order, swapping."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.server.config import SchedulerConfig, choose_token_budget
from pagedllm.server.core.block_manager import BlockManager
from pagedllm.server.core.scheduler import Scheduler
from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.core.sequence_updates import GroupUpdate, NewSeq
from pagedllm.server.sampling_params import SamplingParams


def make_scheduler(num_blocks=16, block_size=4, device="cpu", **config) -> Scheduler:
    """A scheduler over a fresh block manager, its token budget resolved as the engine does on ``device``."""
    bm = BlockManager(block_size, num_blocks, num_blocks, watermark=0.0)
    sched = SchedulerConfig(**config)
    budget = choose_token_budget(sched, device, max_model_len=num_blocks * block_size)
    return Scheduler(sched.with_token_budget(budget), bm)


def make_request(request_id: str, num_tokens: int, seq_id: int, arrival: float, best_of: int = 1) -> SequenceGroup:
    params = SamplingParams(n=1, best_of=best_of, temperature=1.0)
    return SequenceGroup(request_id, [Sequence(seq_id, list(range(num_tokens)))], params, arrival_time=arrival)


def run_step(scheduler: Scheduler, new_token: int = 1):
    """Schedule, pretend the model ran, and append a token where the sequence completed."""
    out = scheduler.schedule()
    done = [
        (item.group, s)
        for item in out.scheduled
        for s in item.group.seqs
        if s.seq_id in item.chunks and s.num_computed_tokens + item.chunks[s.seq_id] == len(s)
    ]
    scheduler.mark_computed(out)
    for _, seq in done:
        seq.append_token(new_token, 0.0, None)
    return out


def test_chunked_prefill_runs_beside_decodes():
    s = make_scheduler(num_blocks=32, max_num_batched_tokens=8)
    s.add(make_request("short", 3, 0, arrival=0.0))
    run_step(s)  # short prefilled, now decoding
    s.add(make_request("long", 20, 1, arrival=1.0))
    chunks = []
    for _ in range(3):
        out = run_step(s)
        by_id = {item.group.request_id: sum(item.chunks.values()) for item in out.scheduled}
        assert by_id["short"] == 1  # the decode is never stalled
        chunks.append(by_id.get("long"))
        assert out.num_batched_tokens <= 8
    assert chunks == [7, 7, 6]


def test_cpu_defaults_chunk_a_long_prompt_beside_decodes():
    s = make_scheduler(num_blocks=256, block_size=16)
    assert s.token_budget == 4096 and s.config.max_prefill_tokens_while_decoding == 256
    s.add(make_request("short0", 3, 0, arrival=0.0))
    s.add(make_request("short1", 3, 1, arrival=0.5))
    run_step(s)
    s.add(make_request("long", 1200, 2, arrival=1.0))
    chunks = []
    for _ in range(5):
        out = run_step(s)
        by_id = {item.group.request_id: sum(item.chunks.values()) for item in out.scheduled}
        assert by_id["short0"] == by_id["short1"] == 1  # the decodes go on in every step of the long prefill
        chunks.append(by_id["long"])
    assert chunks == [256, 256, 256, 256, 176]


def _tokens_by_request(out) -> dict[str, int]:
    return {item.group.request_id: sum(item.chunks.values()) for item in out.scheduled}


def test_prompt_tokens_are_bounded_while_more_sequences_decode_than_prompts_wait():
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=5)
    s.add(make_request("d0", 3, 0, arrival=0.0))
    s.add(make_request("d1", 3, 1, arrival=1.0))
    assert _tokens_by_request(run_step(s)) == {"d0": 3, "d1": 3}  # nothing decodes yet: the whole budget
    s.add(make_request("long", 20, 2, arrival=2.0))
    chunks = []
    for _ in range(4):
        out = run_step(s)
        by_id = _tokens_by_request(out)
        assert by_id["d0"] == by_id["d1"] == 1
        chunks.append(by_id["long"])
    assert chunks == [5, 5, 5, 5]


def test_prompts_as_many_as_the_decodes_take_the_whole_budget():
    # NOTE: one stall of the few decoding streams, not many steps each stalling them again
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=5)
    s.add(make_request("d", 3, 0, arrival=0.0))
    run_step(s)
    s.add(make_request("a", 20, 1, arrival=1.0))
    assert _tokens_by_request(run_step(s)) == {"d": 1, "a": 20}
    s.add(make_request("b", 20, 2, arrival=2.0))
    s.add(make_request("c", 9, 3, arrival=3.0))
    assert _tokens_by_request(run_step(s)) == {"d": 1, "a": 1, "b": 20, "c": 9}


def test_prompts_without_a_free_seat_do_not_lift_the_bound():
    s = make_scheduler(num_blocks=64, max_num_seqs=3, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=5)
    s.add(make_request("d0", 3, 0, arrival=0.0))
    s.add(make_request("d1", 3, 1, arrival=1.0))
    run_step(s)
    for i in range(2, 5):
        s.add(make_request(f"p{i}", 20, i, arrival=float(i)))
    # three prompts wait but one seat is free: one prompt against two decodes, so the bound holds
    assert _tokens_by_request(run_step(s)) == {"d0": 1, "d1": 1, "p2": 5}


def test_without_a_bound_prompts_fill_the_budget_beside_decodes():
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=16)
    for i in range(3):
        s.add(make_request(f"d{i}", 3, i, arrival=float(i)))
    run_step(s)
    s.add(make_request("long", 40, 3, arrival=5.0))
    assert _tokens_by_request(run_step(s)) == {"d0": 1, "d1": 1, "d2": 1, "long": 13}


def test_an_unresolved_budget_is_refused():
    with pytest.raises(RuntimeError, match="choose_token_budget"):
        Scheduler(SchedulerConfig(), BlockManager(4, 4, 4))


def test_admission_is_first_come_first_served():
    s = make_scheduler(num_blocks=6)
    s.add(make_request("a", 12, 0, arrival=0.0))  # 3 blocks
    s.add(make_request("big", 16, 1, arrival=1.0))  # 4 blocks: must wait for "a"
    s.add(make_request("small", 2, 2, arrival=2.0))  # fits, but must not overtake "big"
    out = run_step(s)
    assert [i.group.request_id for i in out.scheduled] == ["a"]
    assert [g.request_id for g in s.waiting] == ["big", "small"]


def test_preempts_latest_arrival_by_recompute():
    s = make_scheduler(num_blocks=4)
    s.add(make_request("old", 4, 0, arrival=0.0))
    s.add(make_request("new", 4, 1, arrival=1.0))
    run_step(s)  # both prefilled: 2 blocks used
    run_step(s)  # both need a second block: 4 used
    for _ in range(3):
        run_step(s)
    out = run_step(s)  # both need a third block: only room for one
    assert [g.request_id for g in out.preempted] == ["new"]
    assert s.waiting[0].request_id == "new"
    assert s.waiting[0].seqs[0].num_computed_tokens == 0
    assert s.num_preemptions == 1


def test_multi_sequence_group_is_swapped_and_resumes_before_admissions():
    s = make_scheduler(num_blocks=6)
    s.add(make_request("other", 6, 1, arrival=0.0))
    group = make_request("beam", 4, 0, arrival=1.0, best_of=2)
    s.add(group)
    run_step(s)
    child = group.seqs[0].fork(5)
    s.block_manager.fork(group.seqs[0], child)
    group.seqs.append(child)
    for _ in range(8):
        out = run_step(s)
        if out.preempted:
            break
    assert out.preempted and out.blocks_to_swap_out
    victim = out.preempted[0]
    assert victim is group
    assert all(seq.status == SequenceStatus.SWAPPED for seq in victim.seqs)
    s.add(make_request("late", 2, 9, arrival=9.0))
    for _ in range(30):
        out = run_step(s)
        ids = [i.group.request_id for i in out.scheduled]
        if "late" in ids:
            assert not s.swapped  # admissions only after swapped groups are back
            break
        s.free_finished()
        for g in list(s.running):  # finish the non-swapped request to make room
            if g is not victim:
                for seq in g.seqs:
                    seq.status = SequenceStatus.FINISHED_LENGTH
    assert not s.swapped


@settings(max_examples=80, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(0, 12), st.integers(1, 30), st.integers(1, 25)), min_size=1, max_size=14
    ),  # (arrival step, prompt tokens, output tokens)
    num_blocks=st.integers(8, 40),
    max_seqs=st.integers(1, 8),
    budget=st.integers(2, 24),
    caching=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 12)),
)
def test_random_arrivals_keep_the_cache_consistent_and_free_everything_at_the_end(
    requests, num_blocks, max_seqs, budget, caching, window
):
    """Every step of one scheduling path (decodes, prefill chunks, preemption, copy-on-write of
    shared prefixes, sliding windows): the block manager's books add up, and aborting what is
    left returns every block."""
    bm = BlockManager(4, num_blocks, num_blocks, enable_prefix_caching=caching, watermark=0.0, sliding_window=window)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), bm)
    groups = {}
    for step in range(120):
        for i, (arrival, prompt, _) in enumerate(requests):
            if arrival == step:
                groups[i] = make_request(str(i), prompt, i, arrival=float(i))  # prompts share prefixes
                sched.add(groups[i])
        out = run_step(sched)
        for item in out.scheduled:
            assert item.group.request_id not in {g.request_id for g in out.preempted}
        for i, group in groups.items():
            seq = group.seqs[0]
            if not seq.status.finished and len(seq.output_token_ids) >= requests[i][2]:
                seq.status = SequenceStatus.FINISHED_LENGTH
        sched.free_finished()
        assert not bm.check_invariants()
    sched.abort([g.request_id for g in groups.values()])
    sched.free_finished()
    assert not bm.check_invariants()
    assert bm.gpu.num_free == num_blocks and bm.cpu.num_free == num_blocks


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("window,block_size", [(10, 4), (8, 4), (3, 4), (1, 2), (37, 8)])
def test_a_windowed_sequence_holds_only_its_window_while_decoding_far_past_it(window, block_size, caching):
    """Every layer slides: decoding 20 windows past the prompt, in a cache far smaller than
    the sequence, never preempts and never holds more than the window's blocks plus one."""
    bound = -(-window // block_size) + 1
    num_blocks = max(-(-30 // block_size), bound) + 1  # the prompt, or the window, and one spare
    bm = BlockManager(block_size, num_blocks, 0, enable_prefix_caching=caching, watermark=0.0, sliding_window=window)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=16), bm)
    group = make_request("long", 30, 0, arrival=0.0)
    s.add(group)
    seq = group.seqs[0]
    while len(seq) < max(30 + 20 * window, 3 * num_blocks * block_size):
        out = run_step(s)
        assert [i.group.request_id for i in out.scheduled] == ["long"] and not out.preempted
        # the logical table keeps every position: the prompt's from admission, then the computed
        # ones (the sampled token gets its block in the next step)
        assert len(bm.block_table(seq)) == -(-max(seq.num_computed_tokens, 30) // block_size)
        if seq.num_computed_tokens >= 30:  # decoding
            assert len(bm.held_blocks(seq)) <= bound
        assert bm.check_invariants() == []
    assert len(seq) > 2 * num_blocks * block_size  # far longer than the whole cache could hold
    assert bm.num_window_frees == len(bm.block_table(seq)) - len(bm.held_blocks(seq)) > 0
    seq.status = SequenceStatus.FINISHED_LENGTH
    s.free_finished()
    assert bm.gpu.num_free == num_blocks


def test_a_request_learns_how_many_prompt_tokens_the_prefix_cache_served():
    bm = BlockManager(4, 16, 16, enable_prefix_caching=True, watermark=0.0)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    first = make_request("first", 11, 0, arrival=0.0)
    s.add(first)
    assert first.num_cached_tokens is None  # not admitted yet
    run_step(s)
    assert first.num_cached_tokens == 0
    first.seqs[0].status = SequenceStatus.FINISHED_LENGTH
    s.free_finished()
    again = make_request("again", 11, 1, arrival=1.0)  # same prompt: two of its full blocks are cached
    longer = SequenceGroup("longer", [Sequence(2, list(range(6)) + [99] * 9)], SamplingParams(), arrival_time=2.0)
    s.add(again)
    s.add(longer)
    run_step(s)
    assert again.num_cached_tokens == 8  # both full blocks of its 11 tokens
    assert longer.num_cached_tokens == 4  # the first block matches, the second differs at its 3rd token


def test_fork_shares_the_parents_blocks_and_drop_releases_one_reference_each():
    s = make_scheduler(num_blocks=16, block_size=4)
    group = make_request("r", 6, 0, arrival=0.0, best_of=2)
    s.add(group)
    run_step(s)  # prefilled: 7 tokens in blocks 0 and 1, the last one shared after the fork
    parent, bm = group.seqs[0], s.block_manager
    assert bm.tables[0] == [0, 1] and bm.gpu.ref_counts[:3] == [1, 1, 0]

    s.updater.apply_group(group, GroupUpdate("r", new_seqs=(NewSeq(0, 5),), seqs=(0, 5)))
    child = group.seqs[1]
    assert child.seq_id == 5 and child.token_ids == parent.token_ids and child is not parent
    assert bm.tables[5] == [0, 1] and bm.tables[0] == [0, 1]
    assert bm.gpu.ref_counts[:3] == [2, 2, 0] and bm.gpu.num_free == 14

    out = run_step(s)  # NOTE: both write into shared block 1: the parent, first, writes into a copy
    assert out.blocks_to_copy == [(1, 2)]
    assert (bm.tables[0], bm.tables[5]) == ([0, 2], [0, 1])
    assert bm.gpu.ref_counts[:4] == [2, 1, 1, 0] and bm.check_invariants() == []

    s.updater.apply_group(group, GroupUpdate("r", drops=(0,)))
    assert 0 not in bm.tables and bm.tables[5] == [0, 1]
    assert bm.gpu.ref_counts[:4] == [1, 1, 0, 0] and bm.gpu.num_free == 14
    s.updater.apply_group(group, GroupUpdate("r", drops=(0,), seqs=(5,)))  # NOTE: a no-op once its blocks are gone
    assert bm.gpu.ref_counts[:4] == [1, 1, 0, 0] and group.seqs == [child]
    s.updater.apply_group(group, GroupUpdate("r", drops=(5,)))
    assert bm.tables == {} and bm.gpu.ref_counts == [0] * 16 and bm.gpu.num_free == 16


def test_a_large_burst_is_prefilled_in_two_steps_and_then_decodes_together():
    s = make_scheduler(num_blocks=256, block_size=16)
    assert s.config.prompt_burst_split_tokens == 512  # the CPU default
    for i in range(4):
        s.add(make_request(f"p{i}", 200, i, arrival=float(i)))
    assert _tokens_by_request(run_step(s)) == {"p0": 200, "p1": 200}  # half the burst's 800 tokens
    assert _tokens_by_request(run_step(s)) == {"p2": 200, "p3": 200}  # p0 and p1 wait for the rest
    assert _tokens_by_request(run_step(s)) == {f"p{i}": 1 for i in range(4)}
    s.add(make_request("late", 600, 4, arrival=5.0))  # not a burst: streams decode, one prompt arrives
    assert _tokens_by_request(run_step(s)) == {**{f"p{i}": 1 for i in range(4)}, "late": 256}


@pytest.mark.parametrize(
    ("prompts", "config"),
    [
        ((100, 100, 100), {}),
        ((200, 200, 200, 200), {"prompt_burst_split_tokens": 0}),
        ((900,), {}),
        ((300, 300, 300), {"max_num_batched_tokens": 600}),
    ],
    ids=["below-the-threshold", "turned-off", "a-lone-prompt", "over-the-token-budget"],
)
def test_bursts_that_are_not_split_take_as_many_steps_as_the_budget_says(prompts, config):
    s = make_scheduler(num_blocks=256, block_size=16, **config)
    for i, n in enumerate(prompts):
        s.add(make_request(f"p{i}", n, i, arrival=float(i)))
    budget = s.token_budget
    first = _tokens_by_request(run_step(s))
    assert sum(first.values()) == min(sum(prompts), budget) and first["p0"] == prompts[0]
    if sum(prompts) > budget:  # chunked by the budget, the streams it answered decoding beside the rest
        assert _tokens_by_request(run_step(s)) == {"p0": 1, "p1": 1, "p2": 256}


def test_held_streams_decode_when_the_rest_of_their_burst_cannot_start():
    s = make_scheduler(num_blocks=30, block_size=16)  # two 200-token prompts take 26 blocks
    for i in range(3):
        s.add(make_request(f"p{i}", 200, i, arrival=float(i)))
    assert _tokens_by_request(run_step(s)) == {"p0": 200, "p1": 200}
    assert _tokens_by_request(run_step(s)) == {"p0": 1, "p1": 1}  # p2 has no room: nobody is held
    assert [g.request_id for g in s.waiting] == ["p2"]


def test_a_stream_with_only_its_first_token_waits_for_the_burst_that_follows_it():
    # NOTE: with a few clients the first of a burst is often prefilled alone, a step before the rest
    s = make_scheduler(num_blocks=256, block_size=16)
    s.add(make_request("first", 200, 0, arrival=0.0))
    run_step(s)
    for i in range(1, 5):
        s.add(make_request(f"p{i}", 200, i, arrival=float(i)))
    assert _tokens_by_request(run_step(s)) == {"p1": 200, "p2": 200}
    assert _tokens_by_request(run_step(s)) == {"p3": 200, "p4": 200}
    assert _tokens_by_request(run_step(s)) == {"first": 1, **{f"p{i}": 1 for i in range(1, 5)}}  # in step
    s.add(make_request("p5", 300, 5, arrival=5.0))
    s.add(make_request("p6", 300, 6, arrival=6.0))
    # streams past their first token: no burst, the prompts are bounded beside the decodes
    assert _tokens_by_request(run_step(s)) == {"first": 1, **{f"p{i}": 1 for i in range(1, 5)}, "p5": 256}
