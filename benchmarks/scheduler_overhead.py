"""What the scheduler costs per step with no model: ``schedule()`` and its bookkeeping for a
batch of decoding sequences, the engine's own share of a step that the throughput benchmark
reports beside the tokens/s."""

from __future__ import annotations

import time


def scheduling_overhead_us(num_seqs: int, steps: int, block_size: int = 16) -> float:
    """Median microseconds per step of schedule() + bookkeeping for ``num_seqs`` decoding sequences."""
    from pagedllm.server.config import SchedulerConfig
    from pagedllm.server.core.block_manager import BlockManager
    from pagedllm.server.core.scheduler import Scheduler
    from pagedllm.server.core.sequence import Sequence, SequenceGroup
    from pagedllm.server.sampling_params import SamplingParams

    bm = BlockManager(block_size, num_seqs * 64, 0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs)), bm)
    for i in range(num_seqs):
        sched.add(SequenceGroup(str(i), [Sequence(i, list(range(161)))], SamplingParams(), arrival_time=i))
    times = []
    for step in range(steps + 64):  # the first steps prefill; time the decode steps
        t0 = time.perf_counter()
        out = sched.schedule()
        sched.mark_computed(out)
        for item in out.scheduled:
            for seq in item.group.seqs:
                if seq.num_computed_tokens == len(seq):
                    seq.append_token(5, 0.0, None)
        sched.free_finished()
        if step >= 64:
            times.append(time.perf_counter() - t0)
    assert len(sched.running) == num_seqs
    times.sort()
    return times[len(times) // 2] * 1e6
