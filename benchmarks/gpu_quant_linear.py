"""The Triton W4A16 GEMM at decode sizes on a GPU, against the memory's floor and cuBLAS bf16.

For each projection of one layer of a ``--shape`` (fused q/k/v, o, fused gate/up, down, as
the engine runs them; benchmarks/cpu_linear.layer_shapes) and each ``--rows`` (sequences in a
decode step), one run measures:

  - ``w4a16_us``: :func:`pagedllm.kernels.quant_matmul.w4a16_matmul` (4-bit, group 128,
    bf16 activations, bf16 scales and zeros), median over CUDA-graph replays by default;
  - ``bf16_us``: ``F.linear`` on the bf16 weight of the same shape (cuBLAS), the peer;
  - ``floor_us``: the bytes the W4A16 call must move (packed weight, scales, zeros, x, y)
    over the device's copy bandwidth measured in the same run (read + write of 1 GiB);
  - ``of_floor``: floor / measured, the goal being >= 0.70 at one row.

NOTE: a 7B layer's 4-bit projection (8-45 MB) fits an H100's 50 MB L2, so one call timed
over and over would read it from the cache. Each projection has enough copies of its
weights to span ``--working-set-mb`` (4x the L2 by default), and one timed pass runs every
copy in turn; the time per call is the pass's over the copies.

    python -m benchmarks.gpu_quant_linear                       # llama-7b and qwen2.5-7b, rows 1 4 16
    python -m benchmarks.gpu_quant_linear --sweep-tiles         # + up to 49 tile sizes (16 gemv), split-K, at one row
    python -m benchmarks.gpu_quant_linear --list                # the cases and their bytes (no GPU)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from dataclasses import asdict, dataclass

from benchmarks.common import HelpFormatter
from benchmarks.cpu_linear import layer_shapes
from benchmarks.model_shapes import SHAPES

BITS = 4
BF16_BYTES = 2


@dataclass(frozen=True)
class Case:
    """One projection at one decode batch: ``x [rows, k] @ W [k, n]``."""

    shape: str
    proj: str
    rows: int
    k: int
    n: int
    group_size: int

    def w4a16_bytes(self) -> int:
        """Bytes one W4A16 call moves: packed codes, scales and zeros (bf16), x read and y written."""
        groups = math.ceil(self.k / self.group_size)
        return (
            self.k * self.n * BITS // 8 + 2 * groups * self.n * BF16_BYTES + (self.k + self.n) * self.rows * BF16_BYTES
        )

    def bf16_bytes(self) -> int:
        """Bytes the bf16 ``F.linear`` of the same shape moves."""
        return self.k * self.n * BF16_BYTES + (self.k + self.n) * self.rows * BF16_BYTES


def cases(shapes: list[str], rows: list[int], group_size: int) -> list[Case]:
    """Every (shape, projection, rows) to time; ``layer_shapes`` gives (out, in) per projection."""
    return [
        Case(shape, proj, r, k=in_features, n=out_features, group_size=group_size)
        for shape in shapes
        for proj, (out_features, in_features) in layer_shapes(shape).items()
        for r in rows
    ]


def copies_for(case_bytes: int, working_set_mb: float) -> int:
    """How many copies of a projection's weights span ``working_set_mb`` (at least one)."""
    return max(1, math.ceil(working_set_mb * 2**20 / case_bytes))


def result_row(case: Case, w4a16_us: float, bf16_us: float, copy_gbs: float, swept: dict | None = None) -> dict:
    """The case's measurements with the floor and the ratios derived from them; with ``swept``
    (µs by tile name), the fastest of those tiles too."""
    floor_us = case.w4a16_bytes() / (copy_gbs * 1e3)
    row = asdict(case) | {
        "w4a16_us": round(w4a16_us, 2),
        "bf16_us": round(bf16_us, 2),
        "floor_us": round(floor_us, 2),
        "of_floor": round(floor_us / w4a16_us, 3),
        "speedup_vs_bf16": round(bf16_us / w4a16_us, 3),
    }
    if swept:
        best = min(swept, key=swept.__getitem__)
        row |= {"best_tiles": best, "best_us": round(swept[best], 2), "best_of_floor": round(floor_us / swept[best], 3)}
    return row


def _weights(case: Case, device: str, dtype):
    """Random packed 4-bit codes, scales and zeros of the case, as the kernel takes them."""
    import torch

    groups = math.ceil(case.k / case.group_size)
    qweight = torch.randint(-(2**31), 2**31 - 1, (case.k * BITS // 32, case.n), dtype=torch.int32, device=device)
    scales = (torch.rand(groups, case.n, device=device) * 0.01).to(dtype)
    zeros = torch.full((groups, case.n), 8.0, device=device).to(dtype)
    return qweight, scales, zeros


def _per_call_us(bench, call, items: list) -> float:
    """µs per ``call(item)`` over one timed pass through every item."""
    return bench(lambda: [call(item) for item in items]) * 1e3 / len(items)


# (block_n, block_k) swept: 4 to 16 KB of packed 4-bit words a loop trip, against the 2 KB of
# the 16x32 tile before split-K; each with every split of K in SWEEP_SPLITS
SWEEP_BLOCKS = ((32, 256), (64, 128), (64, 256), (64, 512), (128, 128), (128, 256))
SWEEP_SPLITS = (1, 2, 4, 8)
# the gemv kernel's (block_n, block_k, warps): 8 or 16 KB of packed 4-bit words a trip, 16 words a
# thread (8 at 16 warps), block_n under the 32 * warps threads (the kernel's NOTE says why), the
# K tile inside a group of 128 or holding 2 or 4 (each word gathers its group's scales); one
# stage, as compiled for sm90 Triton pipelines none of its loads at any number
GEMV_SWEEP_BLOCKS = ((64, 256, 4), (64, 512, 8), (128, 256, 8), (256, 128, 16))


def sweep_tiles(rows: int, k: int, group_size: int) -> list:
    """The tile sizes ``--sweep-tiles`` tries at ``rows`` rows of a ``k``-deep product: each of
    SWEEP_BLOCKS with each split of K, at the warps that hold the dequantized tile at 64 values a
    thread (4 to 8) and 4 stages; 32x256 and 64x256 also at the other warp count and 3 stages;
    the 16x32 tile before split-K, to compare in the same run; and up to GEMV_MAX_ROWS rows, each
    of GEMV_SWEEP_BLOCKS with each split for the gemv kernel (unmeasured so far). A split that
    does not cut K into slices of whole K tiles and whole groups is left out."""
    from pagedllm.kernels.quant_gemv import GEMV_MAX_ROWS
    from pagedllm.kernels.quant_matmul import Tiles

    block_m = max(16, 1 << (rows - 1).bit_length())
    tiles = [Tiles(block_m, 32, 128, 4, 4)]
    for (bn, bk), split in itertools.product(SWEEP_BLOCKS, SWEEP_SPLITS):
        warps = 4 if bn * bk <= 4 * 32 * 64 else 8
        tiles.append(Tiles(block_m, bn, bk, warps, 4, split_k=split))
        if (bn, bk) in ((32, 256), (64, 256)):
            tiles.append(Tiles(block_m, bn, bk, 8 if warps == 4 else 4, 3, split_k=split))
    if rows <= GEMV_MAX_ROWS:
        gemv_rows = 1 << (rows - 1).bit_length()
        tiles += [Tiles(gemv_rows, bn, bk, warps, 1, split_k=split, kind="gemv")
                  for (bn, bk, warps), split in itertools.product(GEMV_SWEEP_BLOCKS, SWEEP_SPLITS)]  # fmt: skip
    return [t for t in tiles if k % (t.split_k * math.lcm(t.block_k, group_size)) == 0]


def tiles_name(t) -> str:
    """The tiles as a result row names them; gemv tiles start with their kind."""
    kind = "gemv-" if t.kind == "gemv" else ""
    return f"{kind}m{t.block_m}-n{t.block_n}-k{t.block_k}-split{t.split_k}-w{t.num_warps}-s{t.num_stages}"


def _swept_us(bench, call, items: list) -> float:
    """:func:`_per_call_us`, or infinity (reported) where a swept tile size cannot run on this GPU."""
    try:
        return _per_call_us(bench, call, items)
    except Exception as err:  # noqa: BLE001 - e.g. Triton's OutOfResources on a GPU with less shared memory
        print(f"    a swept tile size failed: {type(err).__name__}: {err}".splitlines()[0])
        return math.inf


def measure(
    case: Case, bench, working_set_mb: float, device: str = "cuda", dtype=None, sweep: list | tuple = ()
) -> tuple[float, float, dict[str, float]]:
    """(W4A16 µs, bf16 µs, W4A16 µs by swept tile name) per call, each over enough weight copies
    to leave the L2 cache.

    ``device`` and ``dtype`` (bfloat16 by default) are for testing the pass on the CPU.
    """
    import torch

    from pagedllm.kernels.quant_matmul import w4a16_matmul

    dtype = dtype or torch.bfloat16
    x = torch.randn(case.rows, case.k, device=device).to(dtype)
    copies = copies_for(case.w4a16_bytes(), working_set_mb)
    quant = [_weights(case, device, dtype) for _ in range(copies)]
    w4a16_us = _per_call_us(bench, lambda qsz: w4a16_matmul(x, *qsz, case.group_size), quant)
    swept = {tiles_name(t): _swept_us(bench, lambda qsz, t=t: w4a16_matmul(x, *qsz, case.group_size, tiles=t), quant)
             for t in sweep}  # fmt: skip
    quant.clear()
    copies = copies_for(case.bf16_bytes(), working_set_mb)
    dense = [torch.randn(case.n, case.k, device=device).to(dtype) for _ in range(copies)]
    bf16_us = _per_call_us(bench, lambda w: torch.nn.functional.linear(x, w), dense)
    dense.clear()
    if device == "cuda":
        torch.cuda.empty_cache()
    return w4a16_us, bf16_us, swept


def _report(row: dict) -> None:
    print(f"{row['shape']:11s} {row['proj']:8s} rows {row['rows']:3d}: W4A16 {row['w4a16_us']:7.1f} us, "
          f"floor {row['floor_us']:6.1f} ({row['of_floor']:4.0%}), "
          f"bf16 {row['bf16_us']:7.1f} us ({row['speedup_vs_bf16']:.2f}x)")  # fmt: skip
    if "best_tiles" in row:
        print(f"    best tiles {row['best_tiles']}: {row['best_us']:.1f} us ({row['best_of_floor']:.0%} of the floor)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_quant_linear", description=__doc__,
                                formatter_class=HelpFormatter)  # fmt: skip
    p.add_argument("--shapes", nargs="+", default=["llama-7b", "qwen2.5-7b"], choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16], help="rows per call (decode batch)")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--working-set-mb", type=float, default=200, help="weights per timed pass (MB), past the L2")
    p.add_argument("--timer", choices=["cudagraph", "do_bench"], default="cudagraph")
    p.add_argument("--rep-ms", type=int, default=100, help="measurement time per point (ms)")
    p.add_argument("--sweep-tiles", action="store_true", help="also time other tile sizes at one row; report the best")
    p.add_argument("--list", action="store_true", help="print the cases and their bytes, then exit")
    p.add_argument("--out", default=None, help="write the rows as JSON to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    todo = cases(args.shapes, args.rows, args.group_size)
    if args.list:
        for c in todo:
            print(f"{c.shape:11s} {c.proj:8s} rows {c.rows:3d}: k {c.k:5d} n {c.n:5d}, {c.w4a16_bytes() / 1e6:6.1f} MB")
        return

    def row_of(c: Case, bench, copy_gbs: float) -> dict:
        sweep = sweep_tiles(c.rows, c.k, c.group_size) if args.sweep_tiles and c.rows == 1 else ()
        w4a16_us, bf16_us, swept = measure(c, bench, args.working_set_mb, sweep=sweep)
        return result_row(c, w4a16_us, bf16_us, copy_gbs, swept)

    time_cases("benchmarks.gpu_quant_linear", args, todo, row_of, _report)


def time_cases(program: str, args: argparse.Namespace, todo: list[Case], row_of, report) -> None:
    """Measure the copy bandwidth, then ``row_of(case, bench, copy_gbs)`` for each case, reported and
    written to ``args.out`` (JSON) as each one ends."""
    import torch

    from benchmarks.kernels import measure_copy_bandwidth, timer

    if not torch.cuda.is_available():
        sys.exit(f"{program} times CUDA kernels and needs a GPU; --list shows the cases without one")
    bench = timer(args.timer, args.rep_ms)
    copy_gbs = measure_copy_bandwidth(timer("do_bench", args.rep_ms), "cuda") / 1e9
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s (read + write)")
    meta = {"device": torch.cuda.get_device_name(), "copy_gbs": round(copy_gbs, 1), "timer": args.timer}
    rows = []
    for c in todo:
        rows.append(row_of(c, bench, copy_gbs))
        report(rows[-1])
        if args.out:  # NOTE: after every case, so a run cut short by its time limit keeps what it measured
            with open(args.out, "w") as f:
                json.dump(meta | {"rows": rows}, f, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
