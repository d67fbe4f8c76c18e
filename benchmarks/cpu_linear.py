"""A model's linear layers at decode sizes on the CPU, against the memory's floor.

Every layer's projections (fused q/k/v, o, fused gate/up, down) and the LM head of a
``--shape`` (benchmarks/model_shapes.py), random weights in ``--dtype``, each layer its own
weights so that a pass reads them from memory as a decode step does (a 0.5B model's layers
are ~24x the last-level cache). For ``--rows`` 1, 4, 16, 64 (sequences in a decode step),
the time of one pass over all layers with the weights packed for oneDNN (what the engine
runs) and plain (``F.linear``), next to:

  - the bandwidth floor: the weights' bytes over the measured streaming read rate (a
    ``sum()`` over a buffer ten times the last-level cache, on the same threads);
  - the rate it reached in GB/s and GFLOP/s. At a few rows a pass is bound by reading the
    weights; at 16 rows and more in bfloat16 it is bound by the multiply units instead
    (16 rows do 16 FLOP per weight byte).

    python -m benchmarks.cpu_linear --threads 2 --shape qwen2.5-0.5b --dtype bfloat16

``--variants`` instead times each projection shape and the LM head on its own, every way of
running it that torch offers (benchmarks/cpu_linear_variants.py), the variants alternating
in one process on the same threads, each as a fraction of the time of reading its weights:

    python -m benchmarks.cpu_linear --variants --threads 1 2 --rows 1 2 4 8 16 --repeats 15
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from tqdm import tqdm

from benchmarks import cpu_linear_variants as cv
from benchmarks.common import HelpFormatter, set_threads
from benchmarks.model_shapes import SHAPES
from pagedllm.server.worker.models.cpu_linear import linear, pack_weight


def layer_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of one layer of ``shape``, q/k/v and gate/up fused as the engine runs them."""
    s = SHAPES[shape]
    hidden, heads, kv_heads = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"]
    head_dim = hidden // heads
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * s["intermediate_size"], hidden),
        "down": (hidden, s["intermediate_size"]),
    }


def streaming_gbs(repeats: int) -> float:
    """GB/s of a ``sum()`` over 512 MB read in order: the rate a pass over the weights cannot beat."""
    data = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    return data.numel() * 4 / median_s(data.sum, repeats) / 1e9


def median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(weights: list[torch.Tensor], rows: int, repeats: int) -> float:
    """Seconds for one pass of ``rows`` rows through every weight in turn."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=weights[0].dtype) for w in weights}
    return median_s(lambda: [linear(inputs[w.shape[1]], w) for w in weights], repeats)


def run(args: argparse.Namespace) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    layers = SHAPES[args.shape]["num_hidden_layers"]
    head = (SHAPES[args.shape]["vocab_size"], SHAPES[args.shape]["hidden_size"])
    parts = {"layers": [s for _ in range(layers) for s in layer_shapes(args.shape).values()], "lm head": [head]}
    bandwidth = streaming_gbs(args.repeats)
    print(f"streaming read: {bandwidth:.1f} GB/s")
    results = []
    for part, shapes in parts.items():
        plain = [torch.randn(shape, dtype=dtype) * 0.02 for shape in shapes]
        packed = [pack_weight(w) for w in plain]
        elements = sum(w.numel() for w in plain)
        nbytes = elements * plain[0].element_size()
        floor_ms = nbytes / bandwidth / 1e6
        for rows in args.rows:
            row = {"part": part, "rows": rows, "MB": nbytes / 1e6, "floor_ms": floor_ms}
            for name, weights in (("packed", packed), ("plain", plain)):
                seconds = measure(weights, rows, args.repeats)
                row[f"{name}_ms"] = seconds * 1e3
                row[f"{name}_of_bandwidth"] = floor_ms / (seconds * 1e3)
                row[f"{name}_gflops"] = 2 * rows * elements / seconds / 1e9
            results.append(row)
            print(
                f"{part:8s} rows {rows:3d}: {nbytes / 1e6:6.0f} MB, floor {floor_ms:6.2f} ms | packed "
                f"{row['packed_ms']:7.2f} ms ({row['packed_of_bandwidth']:4.0%} of bandwidth, "
                f"{row['packed_gflops']:5.0f} GFLOP/s) | plain {row['plain_ms']:7.2f} ms "
                f"({row['plain_of_bandwidth']:4.0%})"
            )
    return results


def variant_cases(shape: str) -> dict[str, tuple[tuple[int, int], int]]:
    """Each projection of ``shape`` and its LM head: ((out, in), copies a decode step reads)."""
    s = SHAPES[shape]
    cases = {name: (dims, s["num_hidden_layers"]) for name, dims in layer_shapes(shape).items()}
    cases["lm_head"] = ((s["vocab_size"], s["hidden_size"]), 1)
    return cases


def time_alternating(variants: dict[str, cv.Variant], x: torch.Tensor, repeats: int) -> dict[str, list[float]]:
    """Each variant's seconds per call, ``repeats`` of them, the variants taking turns so that load hits all alike.

    NOTE: each round runs them in a fresh random order (seeded): the one right after the floor
    (or any other) is not always the same.
    """
    for run in variants.values():
        run(x)
    times: dict[str, list[float]] = {name: [] for name in variants}
    order, shuffle = list(variants), random.Random(0).shuffle
    for _ in range(repeats):
        shuffle(order)
        for name in order:
            start = time.perf_counter()
            variants[name](x)
            times[name].append(time.perf_counter() - start)
    return times


def variant_row(case: str, rows: int, threads: int, nbytes: int, times: dict[str, list[float]]) -> dict:
    """One case's result: the floor's GB/s, then each variant's ms and fraction of the floor, by median and by best.

    NOTE: on a shared machine a call is often descheduled midway; the best of the repeats is
    the estimate of the call alone, the median what a step met under that load.
    """
    floor, best_floor = statistics.median(times["floor"]), min(times["floor"])
    row = {"case": case, "rows": rows, "threads": threads, "MB": nbytes / 1e6}
    row.update(floor_gbs=nbytes / floor / 1e9, floor_best_gbs=nbytes / best_floor / 1e9)
    for name, t in times.items():
        if name != "floor":
            row[f"{name}_ms"] = statistics.median(t) * 1e3
            row[f"{name}_of_floor"] = floor / statistics.median(t)
            row[f"{name}_best_of_floor"] = best_floor / min(t)
    return row


def format_variant_row(row: dict) -> str:
    parts = [f"{row['case']:8s} rows {row['rows']:2d} threads {row['threads']}: floor {row['floor_gbs']:5.1f} GB/s"]
    parts[0] += f" (best {row['floor_best_gbs']:5.1f})"
    for name in variant_names([row]):
        parts.append(
            f"{name} {row[name + '_ms']:6.2f} ms {row[name + '_of_floor']:4.0%} ({row[name + '_best_of_floor']:4.0%})"
        )
    return " | ".join(parts)


def variant_names(results: list[dict]) -> list[str]:
    """The variants timed in ``results``, in order of first appearance."""
    suffix = "_best_of_floor"
    return list(dict.fromkeys(k[: -len(suffix)] for r in results for k in r if k.endswith(suffix)))


def run_variants(args: argparse.Namespace) -> list[dict]:
    """Every case of ``--shape`` at every ``--rows`` and ``--threads``, the variants alternating."""
    dtype, names = getattr(torch, args.dtype), tuple(args.variant_names)
    cases = variant_cases(args.shape)
    results = []
    bar = tqdm(total=len(cases) * len(args.threads) * len(args.rows), desc="cases")
    for case, ((out_features, in_features), copies) in cases.items():
        plain = [torch.randn(out_features, in_features, dtype=dtype) * 0.02 for _ in range(copies)]
        nbytes = sum(w.numel() * w.element_size() for w in plain)
        for threads in args.threads:
            torch.set_num_threads(threads)
            bar.write(f"{case}: {copies} x ({out_features}, {in_features}), torch threads: {torch.get_num_threads()}")
            static = cv.static_variants(plain, threads, names)
            for rows in args.rows:
                x = torch.randn(rows, in_features, dtype=dtype)
                cv.reset_compiled()
                made = names if rows in args.inductor_rows else tuple(n for n in names if n not in cv.INDUCTOR)
                variants = {**static, **cv.row_variants(plain, x, made)}
                row = variant_row(case, rows, threads, nbytes, time_alternating(variants, x, args.repeats))
                results.append(row)
                bar.write(format_variant_row(row))
                bar.update()
            if isinstance(static.get("split-n"), cv.SplitN):
                static["split-n"].close()
    return results


def markdown_table(results: list[dict]) -> str:
    """The rows as a markdown table: the floor's GB/s, then each variant's fraction of it, median (best)."""
    names = variant_names(results)
    lines = ["| case | rows | threads | floor GB/s | " + " | ".join(names) + " |", "|" + "---|" * (4 + len(names))]
    for r in results:
        cells = [f"{r[n + '_of_floor']:.2f} ({r[n + '_best_of_floor']:.2f})" if n + "_ms" in r else "-" for n in names]
        head = f"| {r['case']} | {r['rows']} | {r['threads']} | {r['floor_gbs']:.1f} ({r['floor_best_gbs']:.1f}) | "
        lines.append(head + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cpu_linear", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="torch threads: --variants runs each, passes the first (default: the quota)",
    )
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES), help="model shape")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="weights' dtype")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64], help="rows per pass (decode batch)")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes per case (median reported)")
    parser.add_argument("--out", default=None, help="write the rows as JSON to this file")
    parser.add_argument("--variants", action="store_true", help="time each shape every way torch offers, not passes")
    parser.add_argument(
        "--variant-names", nargs="+", default=list(cv.ALL[1:]), choices=cv.ALL[1:], help="with --variants"
    )
    parser.add_argument(
        "--inductor-rows", type=int, nargs="+", default=[1, 16], help="with --variants: rows compiled for inductor"
    )
    args = parser.parse_args()
    threads = set_threads(args.threads[0] if args.threads else None)
    if args.variants:
        args.threads = args.threads or [threads]
        results = run_variants(args)
        print(markdown_table(results))
    else:
        results = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": args.shape, "dtype": args.dtype, "threads": threads, "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()
