"""The quantized-linear benchmark times every candidate on every projection and sums them per layer."""

from __future__ import annotations

import argparse

import torch

from benchmarks.quant_linear import format_row, kernels, run, time_case
from pagedllm.kernels import w4_gemm_cpu


def test_every_candidate_computes_the_same_product():
    with torch.inference_mode():
        tiles = ("w4-tiles",) if w4_gemm_cpu.available() else ()
        tiles += ("w4a8-tiles",) if w4_gemm_cpu.int8_available() else ()
        fns = kernels((128, 256), 128, ("int4", "int4-deq", *tiles, "bf16", "bf16-plain"))
        x = torch.randn(3, 256, dtype=torch.bfloat16)
        want = fns["bf16-plain"](x).float()
        for name, fn in fns.items():
            torch.testing.assert_close(fn(x).float(), want, atol=0.05, rtol=0.05, msg=name)


def test_each_thread_count_and_candidate_is_timed_in_turn():
    calls: list[tuple[int, str]] = []
    fns = {name: (lambda name=name: calls.append((torch.get_num_threads(), name))) for name in ("a", "b")}
    before = torch.get_num_threads()
    try:
        medians = time_case(fns, [1, 2], repeats=3)
    finally:
        torch.set_num_threads(before)
    assert set(medians) == {(1, "a"), (1, "b"), (2, "a"), (2, "b")}
    timed = calls[4:]  # NOTE: one warm-up call each first
    assert len(timed) == 12 and all(timed.count(pair) == 3 for pair in medians)
    assert timed[:4] != timed[4:8]  # the order rotates between repeats


def test_the_layer_rows_sum_the_projections():
    args = argparse.Namespace(
        shape="qwen2.5-0.5b", threads=[1], rows=[1], kernels=["int4", "bf16"], group=128, layers=1, repeats=1
    )
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            rows = run(args)
    finally:
        torch.set_num_threads(before)
    assert [r["proj"] for r in rows] == ["qkv", "o", "gate_up", "down", "layer"]
    assert rows[-1]["ms"]["int4"] == sum(r["ms"]["int4"] for r in rows[:4])
    assert "bf16/int4" in format_row(rows[-1]) and "fastest 4-bit: int4" in format_row(rows[-1])
