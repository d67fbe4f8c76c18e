"""The fp8 GPU benchmark's host-side arithmetic and one pass of every candidate on the CPU."""

from __future__ import annotations

import torch

from benchmarks.gpu_fp8_linear import CANDIDATES, fp8_bytes, main, measure, result_row
from benchmarks.gpu_quant_linear import Case, copies_for


def test_fp8_bytes_count_the_weight_its_scales_and_the_activations():
    c = Case("llama-3-8b", "o", rows=16, k=4096, n=4096, group_size=1)
    assert fp8_bytes(c) == 4096 * 4096 + 4 * 4096 + (4096 + 4096) * 16 * 2
    assert c.bf16_bytes() / fp8_bytes(c) > 1.9  # one byte a weight against two


def test_every_candidate_runs_once_per_copy_in_a_pass():
    # NOTE: torch runs _scaled_mm on the CPU, and the per-token quantization takes its torch twin there
    c = Case("tiny", "o", rows=3, k=64, n=32, group_size=1)
    passes = []

    def bench(fn):
        outputs = fn()
        passes.append(len(outputs))
        for y in outputs:
            assert isinstance(y, tuple) or (y.shape == (3, 32) and torch.isfinite(y.float()).all())
        return 1.0  # ms

    us = measure(c, bench, working_set_mb=0.01, device="cpu")
    fp8_copies, bf16_copies = copies_for(fp8_bytes(c), 0.01), copies_for(c.bf16_bytes(), 0.01)
    assert list(us) == list(CANDIDATES) and fp8_copies > 1
    assert passes == [fp8_copies] * 5 + [bf16_copies]
    assert us["bf16"] == 1000.0 / bf16_copies and us["fp8"] == 1000.0 / fp8_copies


def test_result_row_puts_the_floor_from_the_copy_bandwidth():
    c = Case("llama-3-8b", "o", rows=1, k=4096, n=4096, group_size=1)
    us = dict.fromkeys(CANDIDATES, 8.0) | {"fp8": 4.0, "bf16": 12.0, "fp8_plain": 6.0, "fp8_swapped": 4.0}
    row = result_row(c, us, copy_gbs=fp8_bytes(c) / 3e3)  # a 3 µs floor
    assert row["floor_us"] == 3.0 and row["fp8_of_floor"] == 0.75 and row["fp8_speedup_vs_bf16"] == 3.0
    assert row["swapped_speedup_vs_plain"] == 1.5 and row["quantize_us"] == 8.0


def test_list_needs_no_gpu(capsys):
    main(["--list", "--shapes", "llama-3-8b", "--rows", "1", "64"])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 8 and "gate_up" in out[4] and "rows   64" in out[1]
