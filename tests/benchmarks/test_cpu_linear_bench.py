"""The linear-layer benchmark measures the projections the engine really runs for a shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks import cpu_linear_variants as cv
from benchmarks.cpu_linear import layer_shapes, markdown_table, time_alternating, variant_cases, variant_row
from pagedllm.server.worker.models.cpu_linear import onednn_bf16


def test_a_layers_projections_are_the_fused_ones_of_the_shape():
    # NOTE: Qwen2.5-0.5B: 14 query heads and 2 KV heads of 64, intermediate 4864
    assert layer_shapes("qwen2.5-0.5b") == {
        "qkv": (1152, 896),
        "o": (896, 896),
        "gate_up": (9728, 896),
        "down": (896, 4864),
    }
    assert layer_shapes("llama-3.2-1b")["qkv"] == (3072, 2048)  # 32 + 2 * 8 heads of 64


def test_variant_cases_are_every_layers_projections_and_the_lm_head():
    cases = variant_cases("qwen2.5-0.5b")
    assert cases["gate_up"] == ((9728, 896), 24)  # one copy per layer: a step reads them all
    assert cases["lm_head"] == ((151936, 896), 1)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_every_eager_variant_computes_the_product():
    g = torch.Generator().manual_seed(0)
    plain = [(torch.randn(48, 32, generator=g) * 0.1).to(torch.bfloat16) for _ in range(2)]
    x = torch.randn(3, 32, generator=g).to(torch.bfloat16)
    variants = cv.static_variants(plain, threads=2, names=("engine", "onednn", "plain", "aten", "split-n"))
    variants.update(cv.row_variants(plain, x, names=("packed-rows",)))
    # NOTE: oneDNN's own variants only where it has a bfloat16 GEMM (not on a CPU with AVX2 only)
    onednn = ["onednn", "packed-rows"] if onednn_bf16() else []
    assert list(variants) == ["floor", "engine", *onednn[:1], "plain", "aten", "split-n", *onednn[1:]]
    for name in [v for v in variants if v != "floor"]:
        for got, w in zip(variants[name](x), plain):
            torch.testing.assert_close(got.float(), F.linear(x, w).float(), atol=2e-2, rtol=2e-2, msg=name)
    variants["split-n"].close()
    assert "split-n" not in cv.static_variants(plain, threads=1, names=("split-n",))


def test_rows_are_fractions_of_the_floor_by_median_and_by_best():
    times = {"floor": [1.0, 2.0, 3.0], "engine": [2.0, 4.0, 9.0]}
    row = variant_row("o", rows=4, threads=1, nbytes=6_000_000_000, times=times)
    assert row["floor_gbs"] == 3.0 and row["floor_best_gbs"] == 6.0
    assert row["engine_ms"] == 4000.0 and row["engine_of_floor"] == 0.5 and row["engine_best_of_floor"] == 0.5
    assert markdown_table([row]).splitlines()[-1] == "| o | 4 | 1 | 3.0 (6.0) | 0.50 (0.50) |"


def test_variants_take_turns_in_shuffled_order():
    calls: list[str] = []
    variants = {name: (lambda x, name=name: calls.append(name)) for name in "abc"}
    times = time_alternating(variants, torch.zeros(1), repeats=20)
    assert calls[:3] == ["a", "b", "c"]  # the warm-up call of each
    rounds = [calls[i : i + 3] for i in range(3, len(calls), 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds) and len({tuple(r) for r in rounds}) > 1
    assert [len(t) for t in times.values()] == [20, 20, 20]
