"""The W4A16 GPU benchmark's host-side arithmetic: cases, bytes, copies past the L2, ratios; and
its gemv candidates compiled for sm90 (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_quant_linear import (
    Case,
    _report,
    cases,
    copies_for,
    main,
    measure,
    result_row,
    sweep_tiles,
    tiles_name,
)
from pagedllm.kernels.quant_gemv import GEMV_MAX_ROWS
from pagedllm.kernels.quant_matmul import Tiles


def test_cases_are_the_fused_projections_of_each_shape():
    got = cases(["llama-7b", "qwen2.5-7b"], [1, 16], 128)
    assert len(got) == 2 * 4 * 2
    by_key = {(c.shape, c.proj, c.rows): (c.k, c.n) for c in got}
    assert by_key["llama-7b", "gate_up", 1] == (4096, 2 * 11008)
    assert by_key["llama-7b", "down", 16] == (11008, 4096)
    assert by_key["qwen2.5-7b", "qkv", 1] == (3584, (28 + 2 * 4) * 128)  # 28 query and 4 KV heads of 128


def test_w4a16_bytes_count_codes_scales_zeros_and_activations():
    c = Case("llama-7b", "o", rows=1, k=4096, n=4096, group_size=128)
    codes = 4096 * 4096 // 2
    scales_and_zeros = 2 * 32 * 4096 * 2
    assert c.w4a16_bytes() == codes + scales_and_zeros + (4096 + 4096) * 2
    assert c.bf16_bytes() == 4096 * 4096 * 2 + (4096 + 4096) * 2
    assert c.bf16_bytes() / c.w4a16_bytes() == pytest.approx(3.76, abs=0.005)  # 2 B against 0.5 + 4 / 128 B a weight


def test_copies_span_the_working_set():
    assert copies_for(8 * 2**20, 200) == 25
    assert copies_for(300 * 2**20, 200) == 1
    assert copies_for(3, 0) == 1


def test_result_row_puts_the_floor_from_the_copy_bandwidth():
    c = Case("llama-7b", "o", rows=1, k=4096, n=4096, group_size=128)
    row = result_row(c, w4a16_us=4.0, bf16_us=12.0, copy_gbs=c.w4a16_bytes() / 3e3)  # a 3 µs floor
    assert row["floor_us"] == 3.0 and row["of_floor"] == 0.75 and row["speedup_vs_bf16"] == 3.0
    assert row["proj"] == "o" and row["k"] == 4096


def test_list_needs_no_gpu(capsys):
    main(["--list", "--shapes", "llama-7b", "--rows", "1"])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and "gate_up" in out[2] and "rows   1" in out[0]


def test_measure_runs_every_copy_once_per_pass():
    # NOTE: on CPU through Triton's interpreter (tests/conftest.py), float32: the pass, not the speed
    c = Case("tiny", "o", rows=1, k=512, n=32, group_size=128)
    passes = []

    def bench(fn):
        passes.append(len(fn()))  # the number of calls one pass made
        return 2.0  # ms

    tiles = sweep_tiles(1, c.k, c.group_size)
    sweep = [next(t for t in tiles if t.split_k == 2 and t.kind == kind) for kind in ("dot", "gemv")]
    w4a16_us, bf16_us, swept = measure(c, bench, working_set_mb=0.05, device="cpu", dtype=torch.float32, sweep=sweep)
    w4a16_copies, bf16_copies = copies_for(c.w4a16_bytes(), 0.05), copies_for(c.bf16_bytes(), 0.05)
    assert passes == [w4a16_copies] * 3 + [bf16_copies] and w4a16_copies > 1  # default tiles, two swept, bf16
    assert w4a16_us == 2000.0 / w4a16_copies and bf16_us == 2000.0 / bf16_copies
    assert list(swept) == [tiles_name(t) for t in sweep]


def test_a_swept_tile_size_that_cannot_run_is_never_the_best(capsys):
    c = Case("tiny", "o", rows=1, k=512, n=32, group_size=128)

    def bench(fn):
        fn()
        return 1.0

    too_small = Tiles(16, 16, 8, 4, 2)  # refused by the launcher, as an oversized tile is by the GPU
    runs = sweep_tiles(1, c.k, c.group_size)[0]
    _, _, swept = measure(c, bench, 0.001, device="cpu", dtype=torch.float32, sweep=[too_small, runs])
    assert swept[tiles_name(too_small)] == float("inf") and "failed: ValueError" in capsys.readouterr().out
    assert result_row(c, 1.0, 1.0, 1.0, swept)["best_tiles"] == tiles_name(runs)


def test_sweep_reports_the_fastest_tiles():
    c = Case("llama-7b", "o", rows=1, k=4096, n=4096, group_size=128)
    row = result_row(c, 4.0, 12.0, c.w4a16_bytes() / 3e3, swept={"a": 5.0, "b": 3.75, "c": 4.0})
    assert row["best_tiles"] == "b" and row["best_us"] == 3.75 and row["best_of_floor"] == 0.8


def test_sweep_tries_split_k_and_long_k_tiles_within_budget():
    tiles = sweep_tiles(1, 4096, 128)
    assert len(tiles) == 49 and len({tiles_name(t) for t in tiles}) == 49  # each ~1 s to compile
    dot = [t for t in tiles if t.kind == "dot"]
    assert len(dot) == 33 and {t.split_k for t in dot} == {1, 2, 4, 8} and {t.block_k for t in dot} == {128, 256, 512}
    assert {t.block_n for t in dot} == {32, 64, 128} and {(t.num_warps, t.num_stages) for t in dot} > {(4, 4)}
    assert Tiles(16, 32, 128, 4, 4) in tiles  # the tiles before split-K, timed in the same run
    assert all(t.block_m == 16 for t in dot) and sweep_tiles(33, 4096, 128)[0].block_m == 64
    assert "split4" in tiles_name(Tiles(16, 64, 256, 8, 4, split_k=4))


@pytest.mark.parametrize("rows", range(1, GEMV_MAX_ROWS + 1))
def test_sweep_adds_gemv_candidates_up_to_its_rows(rows):
    gemv = [t for t in sweep_tiles(rows, 4096, 128) if t.kind == "gemv"]
    assert len(gemv) == 4 * 4 and {t.block_m for t in gemv} == {1 << (rows - 1).bit_length()}
    assert {t.split_k for t in gemv} == {1, 2, 4, 8} and {(t.block_n, t.block_k) for t in gemv} == {
        (64, 256), (64, 512), (128, 256), (256, 128)}  # fmt: skip
    assert all(tiles_name(t).startswith(f"gemv-m{t.block_m}-n{t.block_n}-") for t in gemv)


@pytest.mark.parametrize("rows", [GEMV_MAX_ROWS + 1, 16, 64, 65])
def test_sweep_has_no_gemv_candidates_past_its_rows(rows):
    assert {t.kind for t in sweep_tiles(rows, 4096, 128)} == {"dot"}


def test_gemv_candidates_keep_block_n_under_the_threads_and_16_words_a_thread():
    for t in (t for t in sweep_tiles(1, 4096, 128) if t.kind == "gemv"):
        threads = 32 * t.num_warps
        assert t.block_n < threads and t.block_k // 8 * t.block_n // threads <= 16, tiles_name(t)


@pytest.mark.parametrize("k", [4096, 14336, 3584, 11008])
def test_swept_splits_cut_k_into_whole_tiles_and_groups(k):
    tiles = sweep_tiles(1, k, 128)
    for t in tiles:
        slice_k = k // t.split_k
        assert k % t.split_k == 0 and slice_k % t.block_k == 0 and slice_k % 128 == 0, tiles_name(t)


def test_sweep_leaves_out_splits_that_cut_a_k_tile():
    tiles = sweep_tiles(1, 14336, 128)
    assert Tiles(16, 64, 512, 8, 4, split_k=8) not in tiles and len(tiles) == 32 + 15  # 14336 / 8 = 1792, not 512s
    assert Tiles(1, 64, 512, 8, 1, split_k=8, kind="gemv") not in tiles
    assert Tiles(16, 64, 128, 4, 4, split_k=8) in tiles


def test_report_names_the_best_tiles_when_swept(capsys):
    c = Case("llama-7b", "o", rows=1, k=4096, n=4096, group_size=128)
    _report(result_row(c, 4.0, 12.0, c.w4a16_bytes() / 3e3))
    _report(result_row(c, 4.0, 12.0, c.w4a16_bytes() / 3e3, swept={"m16-n64-k256-w4-s3": 3.5}))
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and "75%" in out[0] and "best tiles m16-n64-k256-w4-s3: 3.5 us (86% of the floor)" in out[2]
