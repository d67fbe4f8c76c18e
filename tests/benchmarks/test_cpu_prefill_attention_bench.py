"""The prefill attention benchmark times what the engine runs: its case holds the prompt's K/V in the cache."""

from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks import cpu_prefill_attention as bench
from pagedllm.kernels import prefill_attention_cpu
from pagedllm.kernels.kv_quant import quantize


def test_causal_flops_count_the_positions_each_query_sees():
    # 3 tokens see 1 + 2 + 3 positions; QK^T and P·V are 2 FLOPs a multiply-add each
    assert bench.causal_flops(3, 2, 4) == 4 * 2 * 4 * 6


def test_the_case_holds_the_prompts_k_and_v_in_its_blocks():
    q, k, v, key_cache, value_cache, tables = bench.make_case(37, 4, 2, 64, 16)
    slots = tables[0].long()[:, None] * 16 + torch.arange(16)
    assert torch.equal(key_cache.view(-1, 2, 64)[slots.flatten()[:37]], k)
    assert torch.equal(value_cache.view(-1, 2, 64)[slots.flatten()[:37]], v)
    *_, int8_keys, _, same = bench.make_case(37, 4, 2, 64, 16, kv_cache_dtype="int8")
    assert torch.equal(same, tables) and int8_keys.dtype == torch.int8 and int8_keys.shape[-1] == 66
    assert torch.equal(int8_keys.view(-1, 2, 66)[slots.flatten()[:37]], quantize(k, torch.int8))


@pytest.mark.skipif(not prefill_attention_cpu.available(), reason="needs the C prefill attention (AVX-512-BF16)")
def test_a_short_run_prints_both_paths(capsys):
    args = argparse.Namespace(heads=14, kv_heads=2, head_dim=64, block_size=16, repeats=1, kv_cache_dtype=["auto"])
    bench.run(40, args)
    out = capsys.readouterr().out
    assert "sdpa" in out and "c kernel" in out and "GFLOP/s" in out
    bench.run(40, argparse.Namespace(**{**vars(args), "kv_cache_dtype": ["int8", "fp8", "fp8_e5m2"]}))
    out = capsys.readouterr().out
    assert all(f"c {name} " in out for name in ("int8", "fp8", "fp8_e5m2")) and "c kernel" not in out
