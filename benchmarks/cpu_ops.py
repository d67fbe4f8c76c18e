"""The CPU forward pass's small ops, plain against what the engine runs, in one run.

Each case times the plain torch version (``before``) and the engine's (``after``)
interleaved, call by call, so that load from other processes falls on both alike, and
reports medians. Shapes are the throughput benchmark's model (hidden 512, MLP 1376,
vocabulary 8000) at a decode batch of 16 and 64.

    python -m benchmarks.cpu_ops --threads 1 2 --dtype float32 bfloat16 --ops linear

``linear``: ``F.linear`` on the plain weight against oneDNN on the weight packed once
(server/worker/models/cpu_linear.py): q/k/v/o (512 -> 512), gate/up (512 -> 1376),
down (1376 -> 512), LM head (512 -> 8000).
``elementwise``: the torch references against the compiled kernels (float32 and bfloat16):
RMSNorm, residual add + RMSNorm (kernels/rms_norm_cpu.py), rotary on q and k
(kernels/rotary_cpu.py, 8 heads of 64), SiLU(gate) * up (kernels/silu_and_mul_cpu.py,
[batch, 1376]; before: the MLP's former ``silu(gate).mul_(up)``). Batch 16 and 64 are
decode steps, 512 a prefill chunk:

    python -m benchmarks.cpu_ops --threads 2 --ops elementwise --batch 16 64 512
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import HelpFormatter
from pagedllm.kernels.rms_norm_cpu import rms_norm_cpu, rms_norm_reference
from pagedllm.kernels.rotary_cpu import rotary_cpu_, rotary_reference
from pagedllm.kernels.silu_and_mul_cpu import silu_and_mul_cpu
from pagedllm.server.worker.models.cpu_linear import linear, pack_weight
from pagedllm.server.worker.models.rope import rotation_table

HIDDEN, INNER, VOCAB = 512, 1376, 8000
Case = tuple[str, Callable[[], object], Callable[[], object]]


def interleaved_medians(before: Callable[[], object], after: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median µs of each, timed alternately."""
    for _ in range(5):
        before(), after()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((before, times[0]), (after, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return tuple(sorted(t)[len(t) // 2] * 1e6 for t in times)  # type: ignore[return-value]


def linear_cases(batch: int, dtype: torch.dtype) -> list[Case]:
    cases = []
    for name, n_in, n_out in (
        ("q/k/v/o 512->512", HIDDEN, HIDDEN),
        ("gate/up 512->1376", HIDDEN, INNER),
        ("down 1376->512", INNER, HIDDEN),
        ("LM head 512->8000", HIDDEN, VOCAB),
    ):
        x = torch.randn(batch, n_in, dtype=dtype)
        w = (torch.randn(n_out, n_in) * 0.02).to(dtype)
        packed = pack_weight(w)
        cases.append((name, lambda x=x, w=w: F.linear(x, w), lambda x=x, p=packed: linear(x, p)))
    return cases


def elementwise_cases(batch: int, dtype: torch.dtype) -> list[Case]:
    x, residual = torch.randn(batch, HIDDEN, dtype=dtype), torch.randn(batch, HIDDEN, dtype=dtype)
    weight = torch.randn(HIDDEN, dtype=dtype)
    cos, sin = rotation_table(64, 4096, {"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.randint(0, 4096, (batch,))
    q = torch.randn(batch, HIDDEN, dtype=dtype)
    gate, up = torch.randn(batch, INNER, dtype=dtype), torch.randn(batch, INNER, dtype=dtype)
    return [
        ("RMSNorm", lambda: rms_norm_reference(x, weight, 1e-6), lambda: rms_norm_cpu(x, weight, 1e-6)),
        (
            "add + RMSNorm",
            lambda: rms_norm_reference(x, weight, 1e-6, residual),
            lambda: rms_norm_cpu(x, weight, 1e-6, residual),
        ),
        (
            "rotary q and k",
            lambda: (rotary_reference(q, cos, sin, positions, 64), rotary_reference(q, cos, sin, positions, 64)),
            lambda: (rotary_cpu_(q, cos, sin, positions, 64), rotary_cpu_(q, cos, sin, positions, 64)),
        ),
        ("SiLU(gate) * up", lambda: F.silu(gate).mul_(up), lambda: silu_and_mul_cpu(gate, up)),
    ]


CASES: dict[str, Callable[[int, torch.dtype], list[Case]]] = {"linear": linear_cases, "elementwise": elementwise_cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--ops", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    print(ROW.format("op", "case", "dtype", "batch", "thr", "before µs", "after µs", "speed-up"))
    with torch.inference_mode():
        for op in args.ops:
            for dtype_name in args.dtype:
                for batch in args.batch:
                    run_cases(op, dtype_name, batch, args.threads, args.repeats)


ROW = "{:10} {:24} {:9} {:>5} {:>3} {:>10} {:>10} {:>8}"


def run_cases(op: str, dtype_name: str, batch: int, threads: list[int], repeats: int) -> None:
    for name, before, after in CASES[op](batch, getattr(torch, dtype_name)):
        for n in threads:
            torch.set_num_threads(n)
            b, a = interleaved_medians(before, after, repeats)
            print(ROW.format(op, name, dtype_name, batch, n, f"{b:.1f}", f"{a:.1f}", f"{b / a:.2f}"), flush=True)


if __name__ == "__main__":
    main()
