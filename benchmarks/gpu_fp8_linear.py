"""The fp8 linear (``torch._scaled_mm``, per-channel weight scales, per-token activations) at
decode and prefill sizes on a GPU, against the memory's floor and cuBLAS bf16.

For each projection of one layer of a ``--shape`` (fused q/k/v, o, fused gate/up, down) and
each ``--rows``, one run times (median over CUDA-graph replays, weights past the L2 as in
:mod:`benchmarks.gpu_quant_linear`):

  - ``bf16``: ``F.linear`` on the bf16 weight of the same shape (cuBLAS), the peer;
  - ``fp8_torch_quant``: the activations quantized by torch's ops
    (:func:`~pagedllm.kernels.fp8_matmul.quantize_per_token_reference`), then ``x_q @ w.T``;
  - ``fp8``: :func:`~pagedllm.kernels.fp8_matmul.fp8_scaled_mm` as the engine calls it (its own
    choice of form, plain unless ``SWAP_AB_MAX_ROWS`` says otherwise);
  - ``fp8_plain`` / ``fp8_swapped``: the same with ``x_q @ w.T`` or ``(w @ x_q.T).T`` forced;
  - ``quantize``: the per-token quantization alone;
  - ``floor``: the fp8 call's bytes (weight, scales, x read, y written) over the device's copy
    bandwidth measured in the same run (read + write of 1 GiB).

    python -m benchmarks.gpu_fp8_linear --shapes llama-3-8b --rows 1 16 64 256 --out fp8.json
    python -m benchmarks.gpu_fp8_linear --list        # the cases and their bytes (no GPU)
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from benchmarks.common import HelpFormatter
from benchmarks.gpu_quant_linear import BF16_BYTES, Case, _per_call_us, cases, copies_for, time_cases
from benchmarks.model_shapes import SHAPES

CANDIDATES = ("bf16", "fp8_torch_quant", "fp8", "fp8_plain", "fp8_swapped", "quantize")


def fp8_bytes(case: Case) -> int:
    """Bytes one fp8 call moves: the e4m3 weight, a float32 scale per column, x read and y written (bf16)."""
    return case.k * case.n + 4 * case.n + (case.k + case.n) * case.rows * BF16_BYTES


def measure(case: Case, bench, working_set_mb: float, device: str = "cuda") -> dict[str, float]:
    """µs per call of each of :data:`CANDIDATES`, each over enough weight copies to leave the L2.

    ``device`` is for testing the pass on the CPU (torch runs ``_scaled_mm`` there too).
    """
    import torch

    from pagedllm.kernels.fp8_matmul import fp8_scaled_mm, quantize_per_token, quantize_per_token_reference

    x = torch.randn(case.rows, case.k, device=device).bfloat16()
    copies = copies_for(fp8_bytes(case), working_set_mb)
    weights = [
        ((torch.randn(case.n, case.k, device=device) * 64).to(torch.float8_e4m3fn),
         torch.rand(case.n, device=device) * 1e-3)
        for _ in range(copies)
    ]  # fmt: skip

    def torch_quant(w):
        x_q, a_scale = quantize_per_token_reference(x)
        return torch._scaled_mm(x_q, w[0].t(), scale_a=a_scale, scale_b=w[1].reshape(1, -1), out_dtype=torch.bfloat16)

    calls = {
        "fp8_torch_quant": torch_quant,
        "fp8": lambda w: fp8_scaled_mm(x, *w),
        "fp8_plain": lambda w: fp8_scaled_mm(x, *w, swap_ab=False),
        "fp8_swapped": lambda w: fp8_scaled_mm(x, *w, swap_ab=True),
        "quantize": lambda w: quantize_per_token(x),
    }
    us = {name: _per_call_us(bench, call, weights) for name, call in calls.items()}
    weights.clear()
    dense_copies = copies_for(case.bf16_bytes(), working_set_mb)
    dense = [torch.randn(case.n, case.k, device=device).bfloat16() for _ in range(dense_copies)]
    us["bf16"] = _per_call_us(bench, lambda w: torch.nn.functional.linear(x, w), dense)
    dense.clear()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {name: us[name] for name in CANDIDATES}


def result_row(case: Case, us: dict[str, float], copy_gbs: float) -> dict:
    """The case's times with the floor and the ratios derived from them."""
    floor_us = fp8_bytes(case) / (copy_gbs * 1e3)
    return (
        asdict(case)
        | {f"{name}_us": round(t, 2) for name, t in us.items()}
        | {
            "floor_us": round(floor_us, 2),
            "fp8_of_floor": round(floor_us / us["fp8"], 3),
            "fp8_speedup_vs_bf16": round(us["bf16"] / us["fp8"], 3),
            "swapped_speedup_vs_plain": round(us["fp8_plain"] / us["fp8_swapped"], 3),
        }
    )


def _report(row: dict) -> None:
    print(f"{row['shape']:11s} {row['proj']:8s} rows {row['rows']:4d}: fp8 {row['fp8_us']:7.1f} us "
          f"(plain {row['fp8_plain_us']:.1f}, swapped {row['fp8_swapped_us']:.1f}, torch quant "
          f"{row['fp8_torch_quant_us']:.1f}, quantize {row['quantize_us']:.1f}), floor {row['floor_us']:.1f} "
          f"({row['fp8_of_floor']:.0%}), bf16 {row['bf16_us']:.1f} ({row['fp8_speedup_vs_bf16']:.2f}x)")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_fp8_linear", description=__doc__,
                                formatter_class=HelpFormatter)  # fmt: skip
    p.add_argument("--shapes", nargs="+", default=["llama-3-8b"], choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256], help="rows (tokens) per call")
    p.add_argument("--working-set-mb", type=float, default=200, help="weights per timed pass (MB), past the L2")
    p.add_argument("--timer", choices=["cudagraph", "do_bench"], default="cudagraph")
    p.add_argument("--rep-ms", type=int, default=50, help="measurement time per point (ms)")
    p.add_argument("--list", action="store_true", help="print the cases and their bytes, then exit")
    p.add_argument("--out", default=None, help="write the rows as JSON to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    todo = cases(args.shapes, args.rows, group_size=1)
    if args.list:
        for c in todo:
            print(f"{c.shape:11s} {c.proj:8s} rows {c.rows:4d}: k {c.k:5d} n {c.n:5d}, {fp8_bytes(c) / 1e6:6.1f} MB")
        return
    time_cases(
        "benchmarks.gpu_fp8_linear",
        args,
        todo,
        lambda c, bench, copy_gbs: result_row(c, measure(c, bench, args.working_set_mb), copy_gbs),
        _report,
    )


if __name__ == "__main__":
    main()
