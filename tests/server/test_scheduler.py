"""Scheduler: FCFS admission, chunked prefill beside decodes, preemption order, swapping."""

from __future__ import annotations

from pagedllm.server.config import SchedulerConfig
from pagedllm.server.core.block_manager import BlockManager
from pagedllm.server.core.scheduler import Scheduler
from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.sampling_params import SamplingParams


def make_scheduler(num_blocks=16, block_size=4, **config) -> Scheduler:
    bm = BlockManager(block_size, num_blocks, num_blocks, watermark=0.0)
    return Scheduler(SchedulerConfig(**config), bm)


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
