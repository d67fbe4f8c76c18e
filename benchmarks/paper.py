"""The paper's evaluation where memory is the limit: paging vs reservation at the same KV budget.

One function, one PNG and one JSON per experiment, under ``benchmarks/results/paper/``:

    fig13   KV waste and running requests: paged vs Orca Max / Pow2 / Oracle (Figs. 2, 13)
    fig12   normalized latency vs request rate, ShareGPT-like and Alpaca-like, with the
            transformers baselines; the highest rate each sustains under a latency bound
    fig14   parallel sampling and beam search, sharing on vs off
    fig16   shared prefix (one-shot ~80, five-shot ~341 tokens), prefix caching on vs off
    fig17   chatbot: history truncated to the last 1024 tokens, paged vs reservations
    fig18   block size 1..256 vs normalized latency (Fig. 18b)
    fig19   recompute vs swap preemption by block size
    fig12kv Fig. 12's latency vs rate, our paged engine with an 8-bit KV cache against its own
            cache format at equal memory (needs --kv-cache-dtype)

Method: every experiment fixes the KV cache to a number of blocks
(``num_gpu_blocks_override``) small enough that memory, not compute, decides how many
requests run at once, and serves the same seeded requests with every system. Online
experiments replay Poisson arrivals against the real engine on a simulated clock that
advances by each step's measured time (see :mod:`sim`). The CPU profile uses a tiny
random LLaMA (2 layers, hidden 64) whose steps cost ~2-10 ms: batching still pays off
up to ~64 sequences there, as it does on a GPU for far larger batches.

From the repository root:

    python -m benchmarks.paper --all              # CPU scale, ~20 minutes on 2 cores
    python -m benchmarks.paper fig13 fig12
    python -m benchmarks.paper --gpu --all        # LLaMA-7B shape, random bf16 weights
    python -m benchmarks.paper fig13 --dtype bfloat16 --kv-cache-dtype int8   # 8-bit cache vs 16-bit

The experiments live in :mod:`benchmarks.paper_memory`, :mod:`benchmarks.paper_features` and
:mod:`benchmarks.paper_kv`,
what they share (profiles, :class:`~benchmarks.paper_setting.Context`, saving) in
:mod:`benchmarks.paper_setting`.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

import torch

from benchmarks import paper_features, paper_kv, paper_memory
from benchmarks.common import HelpFormatter
from benchmarks.paper_setting import CPU, GPU, Context, build_model

EXPERIMENTS = {**paper_memory.EXPERIMENTS, **paper_features.EXPERIMENTS, **paper_kv.EXPERIMENTS}


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    table = EXPERIMENTS
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.paper", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("names", nargs="*", help=f"experiments to run, of {sorted(table)}")
    parser.add_argument("--all", action="store_true", help="run every experiment")
    parser.add_argument("--gpu", action="store_true", help="the GPU profile (LLaMA-7B shape, bf16, dummy weights)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every workload")
    parser.add_argument("--workloads", default="sharegpt,alpaca", help="workloads of fig12, comma-separated")
    parser.add_argument(
        "--clocks", default=None, help="clocks of fig12/fig17, comma-separated (default: the profile's, see sim.py)"
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="our KV cache's format (auto, fp8, fp8_e5m2, int8), at equal memory"
    )
    parser.add_argument(
        "--dtype", default=None, help="the model's dtype (default: the profile's); results are named cpu-<dtype>"
    )
    args = parser.parse_args()
    names = sorted(table) if args.all else args.names
    unknown = sorted(set(names) - set(table))
    if not names or unknown:
        parser.error(f"name experiments from {sorted(table)} or pass --all (unknown: {unknown})")
    torch.set_num_threads(args.threads)
    profile = GPU if args.gpu else CPU
    if args.dtype:
        engine = {**profile.engine, "dtype": args.dtype}
        profile = dataclasses.replace(profile, name=f"{profile.name}-{args.dtype}", engine=engine)
    with tempfile.TemporaryDirectory() as model_dir:
        vocab = build_model(profile, model_dir)
        clocks = tuple(args.clocks.split(",")) if args.clocks else profile.clocks
        workloads = tuple(args.workloads.split(","))
        ctx = Context(
            profile, model_dir, args.seed, args.threads, vocab, clocks, workloads, kv_cache_dtype=args.kv_cache_dtype
        )
        for name in names:
            print(f"== {name} ({profile.name}, {args.threads} thread(s))", flush=True)
            table[name](ctx)


if __name__ == "__main__":
    main()
