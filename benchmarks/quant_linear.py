"""Quantized linear kernels at decode sizes on the CPU: which one the engine should run.

For a ``--shape``'s layer projections (fused q/k/v, o, fused gate/up, down; ``--layers``
copies with their own weights, so a pass reads them from memory as a decode step does),
random 4-bit weights with group 128 and zero points, and ``--rows`` 1, 4, 16 of bfloat16
activations, the time of one pass through:

  - ``bf16``        the unquantized weights, oneDNN-packed (what an unquantized model runs);
  - ``int4-cpu``    torch's packed int4 weight-only matmul (``_weight_int4pack_mm_for_cpu``);
  - ``int8-cpu``    torch's int8 weight-only matmul, per channel (``_weight_int8pack_mm``);
  - ``int8-w8a8``   activations quantized to int8 per token, an int32 GEMM (``torch._int_mm``);
  - ``dequantize``  the weight dequantized per call, then one bf16 GEMM (the reference).

    OMP_NUM_THREADS=2 python -m benchmarks.quant_linear --threads 2 --shape qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.common import HelpFormatter, set_threads
from benchmarks.cpu_linear import layer_shapes, median_s
from pagedllm.server.worker.models.cpu_linear import linear, pack_weight
from pagedllm.server.worker.quantization.base import QuantizedWeight
from pagedllm.server.worker.quantization.kernels import (
    DequantizeKernel,
    Int4CpuKernel,
    Int8CpuKernel,
    Int8W8A8CpuKernel,
)


def kernels(shape: tuple[int, int], group: int) -> dict:
    """Every candidate for one random [out, in] weight, keyed by name."""
    n, k = shape
    q4 = QuantizedWeight(
        torch.randint(0, 16, (n, k), dtype=torch.uint8),
        torch.rand(n, k // group) * 0.01,
        torch.randint(0, 16, (n, k // group)).float(),
        group,
        4,
    )
    q8 = QuantizedWeight(
        torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, 1) * 0.01, None, k, 8, None, True
    )
    bf16 = pack_weight(q4.dequantize(torch.bfloat16))
    return {
        "bf16": lambda x: linear(x, bf16),
        "int4-cpu": Int4CpuKernel(q4, torch.bfloat16),
        "int8-cpu": Int8CpuKernel(q8, torch.bfloat16),
        "int8-w8a8": Int8W8A8CpuKernel(q8),
        "dequantize": DequantizeKernel(q4),
    }


def run(args: argparse.Namespace) -> list[dict]:
    shapes = list(layer_shapes(args.shape).values()) * args.layers
    layers = [kernels(shape, args.group) for shape in shapes]
    results = []
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for _, k in shapes}
        row: dict = {"rows": rows}
        for name in layers[0]:
            fns = [(layer[name], inputs[k]) for layer, (_, k) in zip(layers, shapes)]
            row[f"{name}_ms"] = median_s(lambda fns=fns: [fn(x) for fn, x in fns], args.repeats) * 1e3
        results.append(row)
        print(f"rows {rows:3d}: " + " | ".join(f"{k[:-3]} {v:7.2f} ms" for k, v in row.items() if k != "rows"))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.quant_linear", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPU quota)")
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="model shape (benchmarks/model_shapes.py)")
    parser.add_argument("--layers", type=int, default=4, help="layers of their own weights per pass")
    parser.add_argument("--group", type=int, default=128, help="4-bit group size")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16], help="rows per pass (decode batch)")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes per case (median reported)")
    parser.add_argument("--out", default=None, help="write the rows as JSON to this file")
    args = parser.parse_args()
    threads = set_threads(args.threads)
    with torch.inference_mode():
        results = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": args.shape, "threads": threads, "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()
