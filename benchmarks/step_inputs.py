"""Input preparation per decode step: the list-based builder against the id-keyed diffs.

A real scheduler and block manager run ``--batch`` decoding sequences (prompts of 161
tokens, the ShareGPT mean, each with its own blocks); every decode step both paths
turn the same ``ScheduledStep`` into the step's arrays (token ids, positions, slot
mapping, block tables, context lengths, sample rows), in alternating order: the list
builder from the live sequences, and the engine's rows plus the scheduler's id-keyed
output applied to a worker's persistent batch. Reported: the median over steps of
each, in microseconds, and the ratio.

    python -m benchmarks.step_inputs --threads 1 --batch 16 64 256
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import HelpFormatter, set_threads
from pagedllm.server.config import SchedulerConfig
from pagedllm.server.core.block_manager import BlockManager
from pagedllm.server.core.scheduler import Scheduler
from pagedllm.server.core.sequence import Sequence, SequenceGroup
from pagedllm.server.engine.reference_inputs import prepare_inputs
from pagedllm.server.engine.step_inputs import StepBuilder
from pagedllm.server.sampling_params import SamplingParams
from pagedllm.server.worker.input_batch import InputBatch


def median_us(times: list[float]) -> float:
    return sorted(times)[len(times) // 2] * 1e6


def run(batch: int, steps: int, block_size: int, prompt_len: int, max_model_len: int) -> tuple[float, float]:
    """Median microseconds per decode step of (list builder, rows + diffs + worker batch)."""
    bm = BlockManager(block_size, batch * (-(-max_model_len // block_size)), 0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch)), bm)
    for i in range(batch):
        prompt = [(i * 7 + k) % 1000 for k in range(prompt_len)]
        sched.add(SequenceGroup(str(i), [Sequence(i, prompt)], SamplingParams(), arrival_time=i))
    input_batch = InputBatch(batch, max_model_len, block_size)
    step_builder = StepBuilder(sched.worker_view)
    builders = {
        "list": lambda out: prepare_inputs(out, bm.tables, block_size),
        "persistent": lambda out: input_batch.step(step_builder.build(out)[1]),
    }
    times: dict[str, list[float]] = {name: [] for name in builders}
    step = 0
    while len(times["list"]) < steps:
        out = sched.schedule()
        decoding = out.num_batched_tokens == batch  # every sequence computes exactly one token
        order = list(builders) if step % 2 == 0 else list(reversed(builders))
        for name in order:
            start = time.perf_counter()
            builders[name](out)
            if decoding:
                times[name].append(time.perf_counter() - start)
        sched.mark_computed(out)
        for item in out.scheduled:
            for seq in item.group.seqs:
                if seq.num_computed_tokens == len(seq):
                    seq.append_token(5, 0.0, None)
        step += 1
    return median_us(times["list"]), median_us(times["persistent"])


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.step_inputs", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPUs allowed)")
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64, 256], help="decoding sequences")
    parser.add_argument("--steps", type=int, default=200, help="decode steps timed per batch size")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=161)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    set_threads(args.threads)
    print(f"{'batch':>6} {'list us':>9} {'diffs us':>14} {'speedup':>8}")
    for batch in args.batch:
        old, new = run(batch, args.steps, args.block_size, args.prompt_len, args.max_model_len)
        print(f"{batch:>6} {old:>9.1f} {new:>14.1f} {old / new:>7.2f}x")


if __name__ == "__main__":
    main()
