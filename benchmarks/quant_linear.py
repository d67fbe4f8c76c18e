"""Quantized linear kernels at decode sizes on the CPU: which one the engine should run, per row count.

For a ``--shape``'s layer projections (fused q/k/v, o, fused gate/up, down; ``--layers``
copies with their own weights, so a pass reads them from memory as a decode step does),
random 4-bit weights with group 128 and zero points (AWQ's layout), and ``--rows`` of
bfloat16 activations, the median time of one pass through each candidate:

  - ``int4``        torch's packed int4 matmul (``_weight_int4pack_mm_for_cpu``), the weight never widened;
  - ``int4-deq``    the same packed weight widened to bfloat16 per call, a tile at a time
                    (``pagedllm.kernels.int4_unpack_cpu``), each tile through oneDNN's GEMM;
  - ``engine``      what an ``int4-cpu`` layer runs: ``int4`` below ``DENSE_ROWS_BFLOAT16`` rows,
                    ``int4-deq`` from there (the engine's 4-bit layer where ``w4-tiles`` cannot run);
  - ``w4-tiles``    the tiled 4-bit kernel (``pagedllm.kernels.w4_gemm_cpu``, layer ``w4a16-tiles``) on
                    bfloat16 activations: what the engine's bfloat16 4-bit layer runs on an AVX-512-BF16
                    CPU without VNNI and VBMI (or with ``PAGEDLLM_W4A8=0``), at every row count;
  - ``w4a8-tiles``  the same weight times x rounded to int8 per row and group (``gemm_int8``): what that
                    layer runs where the CPU has them;
  - ``bf16``        the unquantized weight, oneDNN-packed (what a bfloat16 model runs: the peer);
  - ``bf16-plain``  the unquantized weight through ``F.linear`` (no prepacking);
  - ``int8``        torch's int8 weight-only matmul, per channel (``_weight_int8pack_mm``);
  - ``w8a8-tiles``  the same int8 weight on the tiled kernel's 8-bit packing, x rounded to int8 per row
                    and group of 128 (what a bfloat16 8-bit layer runs where the CPU has VNNI and VBMI);
  - ``w8a8``        activations quantized to int8 per token, an int32 GEMM (``torch._int_mm``).

Each repeat runs every (threads, candidate) pair once, in turn, in this one process
(``torch.set_num_threads`` switched between them), so a busy neighbour slows all of them
alike; the table gives medians, ``bf16 / int4``, ``bf16 / engine``, ``bf16 / w4-tiles`` and
``bf16 / w4a8-tiles`` (above 1: faster than bfloat16) and the fastest of the 4-bit candidates.
``--kernels`` picks candidates (default: the first seven, less the tiled ones where they cannot run)::

    python -m benchmarks.quant_linear --shape qwen2.5-0.5b --threads 1 2 --rows 1 4 8 16 32 64

``--out`` writes the rows as JSON. torch 2.13's other 4-bit CPU entry points do not serve:
``_weight_int4pack_mm`` and ``_weight_int4pack_mm_with_scales_and_zeros`` have no CPU kernel,
and ``_dyn_quant_matmul_4bit`` (int8 activations) runs a reference loop on x86 (27 ms for the
gate/up projection at one row, 330 ms at 16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import HelpFormatter
from benchmarks.cpu_linear import layer_shapes
from pagedllm.kernels import w4_gemm_cpu
from pagedllm.server.worker.models.cpu_linear import linear, pack_weight
from pagedllm.server.worker.quantization.base import QuantizedWeight
from pagedllm.server.worker.quantization.kernels import Int4CpuKernel, Int8CpuKernel, Int8W8A8CpuKernel
from pagedllm.server.worker.quantization.w4a16_cpu import W4A16TilesKernel, W8A8TilesKernel

CANDIDATES = (
    "int4",
    "int4-deq",
    "engine",
    "w4-tiles",
    "w4a8-tiles",
    "bf16",
    "bf16-plain",
    "int8",
    "w8a8-tiles",
    "w8a8",
)
QUANTIZED = ("int4", "int4-deq", "w4-tiles", "w4a8-tiles")
"""The candidates that run from the 4-bit weight alone: the ones a 4-bit model may switch between."""


def kernels(shape: tuple[int, int], group: int, names: tuple[str, ...]) -> dict[str, Callable]:
    """Every candidate in ``names`` for one random [out, in] weight, keyed by name."""
    n, k = shape
    q4 = QuantizedWeight(
        torch.randint(0, 16, (n, k), dtype=torch.uint8),
        torch.rand(n, k // group) * 0.01,
        torch.randint(0, 16, (n, k // group)).float(),
        group,
        4,
    )
    int4 = Int4CpuKernel(q4, torch.bfloat16)
    plain = q4.dequantize(torch.bfloat16)
    builders: dict[str, Callable[[], Callable]] = {
        "int4": lambda: int4.packed_mm,
        "int4-deq": lambda: int4.unpacked_mm,
        "engine": lambda: int4,
        "w4-tiles": lambda: W4A16TilesKernel(q4, int8=False),
        "w4a8-tiles": lambda: W4A16TilesKernel(q4, int8=True),
        "bf16": lambda: (lambda w: lambda x: linear(x, w))(pack_weight(plain)),
        "bf16-plain": lambda: lambda x: F.linear(x, plain),
        "int8": lambda: Int8CpuKernel(_int8(n, k), torch.bfloat16),
        "w8a8-tiles": lambda: W8A8TilesKernel(_int8(n, k)),
        "w8a8": lambda: Int8W8A8CpuKernel(_int8(n, k)),
    }
    return {name: builders[name]() for name in names}


def _int8(n: int, k: int) -> QuantizedWeight:
    return QuantizedWeight(
        torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, 1) * 0.01, None, k, 8, None, True
    )


def time_case(fns: dict[str, Callable[[], object]], threads: list[int], repeats: int) -> dict[tuple[int, str], float]:
    """Median seconds of each (threads, candidate), every repeat running each pair once in a rotating order."""
    pairs = [(t, name) for t in threads for name in fns]
    times: dict[tuple[int, str], list[float]] = {pair: [] for pair in pairs}
    for t, name in pairs:  # NOTE: warm-up: first-call allocations and oneDNN primitive creation
        torch.set_num_threads(t)
        fns[name]()
    for repeat in range(repeats):
        shift = repeat % len(pairs)
        for t, name in pairs[shift:] + pairs[:shift]:
            torch.set_num_threads(t)
            start = time.perf_counter()
            fns[name]()
            times[(t, name)].append(time.perf_counter() - start)
    return {pair: statistics.median(values) for pair, values in times.items()}


def run(args: argparse.Namespace) -> list[dict]:
    """One result row per (projection, rows, threads), then one per (rows, threads) for the whole layer."""
    shapes = layer_shapes(args.shape)
    names = tuple(args.kernels)
    results = []
    for proj, shape in shapes.items():
        layers = [kernels(shape, args.group, names) for _ in range(args.layers)]
        for rows in args.rows:
            x = torch.randn(rows, shape[1], dtype=torch.bfloat16)
            fns = {name: passes([layer[name] for layer in layers], x) for name in names}
            medians = time_case(fns, args.threads, args.repeats)
            for t in args.threads:
                ms = {name: medians[(t, name)] / args.layers * 1e3 for name in names}
                results.append({"proj": proj, "shape": list(shape), "rows": rows, "threads": t, "ms": ms})
                print(format_row(results[-1]), flush=True)
    for rows in args.rows:
        for t in args.threads:
            parts = [r for r in results if r["rows"] == rows and r["threads"] == t]
            ms = {name: sum(r["ms"][name] for r in parts) for name in names}
            results.append({"proj": "layer", "shape": None, "rows": rows, "threads": t, "ms": ms})
            print(format_row(results[-1]), flush=True)
    return results


def passes(fns: list[Callable], x: torch.Tensor) -> Callable[[], list]:
    """One pass: each copy of a projection applied to ``x``."""
    return lambda: [fn(x) for fn in fns]


def format_row(row: dict) -> str:
    ms = row["ms"]
    cells = " | ".join(f"{name} {value:7.3f}" for name, value in ms.items())
    ratio = "".join(
        f" | bf16/{name} {ms['bf16'] / ms[name]:.2f}"
        for name in ("int4", "engine", "w4-tiles", "w4a8-tiles")
        if "bf16" in ms and name in ms
    )
    quantized = [name for name in QUANTIZED if name in ms]
    fastest = f" | fastest 4-bit: {min(quantized, key=ms.__getitem__)}" if quantized else ""
    return f"{row['proj']:>8s} rows {row['rows']:3d} threads {row['threads']}: {cells} ms{ratio}{fastest}"


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.quant_linear", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads, alternated")
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="model shape (benchmarks/model_shapes.py)")
    parser.add_argument("--layers", type=int, default=3, help="copies of each projection, own weights, per pass")
    parser.add_argument("--group", type=int, default=128, help="4-bit group size")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64], help="rows per pass")
    runs = {
        "w4-tiles": w4_gemm_cpu.available(),
        "w4a8-tiles": w4_gemm_cpu.int8_available(),
        "w8a8-tiles": w4_gemm_cpu.w8_available(),
    }
    default = [c for c in CANDIDATES[:7] if runs.get(c, True)]
    parser.add_argument("--kernels", nargs="+", default=default, choices=CANDIDATES, help="candidates")
    parser.add_argument("--repeats", type=int, default=21, help="timed passes per case (median reported)")
    parser.add_argument("--out", default=None, help="write the rows as JSON to this file")
    args = parser.parse_args()
    with torch.inference_mode():
        results = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": args.shape, "group": args.group, "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()
