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
"""

from __future__ import annotations

import argparse
import json
import time

import torch

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


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cpu_linear", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPU quota)")
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES), help="model shape")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="weights' dtype")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64], help="rows per pass (decode batch)")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes per case (median reported)")
    parser.add_argument("--out", default=None, help="write the rows as JSON to this file")
    args = parser.parse_args()
    threads = set_threads(args.threads)
    results = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": args.shape, "dtype": args.dtype, "threads": threads, "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()
