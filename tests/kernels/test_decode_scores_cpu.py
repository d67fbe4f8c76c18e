"""The C scores pass of CPU decode attention over a bfloat16 cache (kernels/decode_scores_cpu.c)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.kernels import decode_scores_cpu
from pagedllm.kernels.paged_decode_attention_cpu import paged_decode_attention_cpu

needs_kernel = pytest.mark.skipif(
    not decode_scores_cpu.available(), reason="needs an x86-64 CPU with AVX-512-BF16, numba and a C compiler"
)


@needs_kernel
@pytest.mark.parametrize(
    "kv_heads,group,head_dim,block_size", [(2, 7, 64, 16), (1, 8, 128, 32), (4, 1, 32, 16), (2, 16, 256, 64)]
)
@pytest.mark.parametrize("start,end", [(0, 1), (0, 37), (5, 70), (16, 48), (3, 4), (47, 83)])
def test_scores_match_float64(kv_heads, group, head_dim, block_size, start, end):
    torch.manual_seed(start * 100 + end)
    blocks = 8
    cache = torch.randn(blocks, block_size, kv_heads, head_dim).to(torch.bfloat16)
    cache[torch.rand(cache.shape) < 0.01] = float("nan")  # NOTE: what lies outside [start, end) is never used
    table = torch.randperm(blocks).to(torch.int32)
    pos = torch.arange(start, end)
    used = (table[pos // block_size].long(), pos % block_size)
    cache[used] = torch.randn(cache[used].shape).to(torch.bfloat16)
    keys = cache[used].double()  # [positions, kv_heads, head_dim]
    for kv0 in range(kv_heads):
        heads = group * (kv_heads - kv0)  # NOTE: the item's heads read KV heads kv0, kv0 + 1, ...
        q = torch.randn(heads, head_dim).to(torch.bfloat16).float()
        got = decode_scores_cpu.scores(
            q.numpy(), cache.view(torch.uint16).numpy(), table.numpy(), start, end, kv0, group, 0.125
        )
        want = torch.stack([q[h].double() @ keys[:, kv0 + h // group].T for h in range(heads)]) * 0.125
        assert got.shape == tuple(want.shape) and not np.isnan(got).any()
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5 * head_dim**0.5)


@needs_kernel
def test_bf16_caches_of_fitting_shapes_take_it_and_agree_with_the_numba_pass(monkeypatch):
    assert decode_scores_cpu.applies(64, 16, 7) and not decode_scores_cpu.applies(80, 16, 7)
    assert not decode_scores_cpu.applies(64, 8, 7) and not decode_scores_cpu.applies(64, 16, 17)
    torch.manual_seed(0)
    blocks, block_size, kv_heads, head_dim = 32, 16, 2, 64
    kc = torch.randn(blocks, block_size, kv_heads, head_dim).to(torch.bfloat16)
    vc = torch.randn(blocks, block_size, kv_heads, head_dim).to(torch.bfloat16)
    q = torch.randn(4, 14, head_dim).to(torch.bfloat16)
    tables = torch.randperm(blocks)[:32].view(4, 8).to(torch.int32)
    lens = torch.tensor([1, 40, 128, 77], dtype=torch.int32)
    with_c = paged_decode_attention_cpu(q, kc, vc, tables, lens, 0.125)
    monkeypatch.setattr(decode_scores_cpu, "applies", lambda *a: False)
    numba_only = paged_decode_attention_cpu(q, kc, vc, tables, lens, 0.125)
    # NOTE: the same float32 sums in another order, each output rounded once to bfloat16
    torch.testing.assert_close(with_c.float(), numba_only.float(), rtol=2**-7, atol=1e-5)


@needs_kernel
def test_a_cache_whose_blocks_are_strided_reads_each_block_where_it_lies(monkeypatch):
    torch.manual_seed(1)
    blocks, block_size, kv_heads, head_dim = 16, 32, 2, 64
    both = torch.randn(blocks, 2, block_size, kv_heads, head_dim).to(torch.bfloat16)  # K and V of a block side by side
    kc, vc = both[:, 0], both[:, 1]
    assert not kc.is_contiguous() and kc[0, 0].is_contiguous()
    q = torch.randn(3, 8, head_dim).to(torch.bfloat16)
    tables = torch.randperm(blocks)[:12].view(3, 4).to(torch.int32)
    lens = torch.tensor([5, 64, 120], dtype=torch.int32)
    with_c = paged_decode_attention_cpu(q, kc, vc, tables, lens, 0.125)
    monkeypatch.setattr(decode_scores_cpu, "applies", lambda *a: False)
    numba_only = paged_decode_attention_cpu(q, kc, vc, tables, lens, 0.125)
    torch.testing.assert_close(with_c.float(), numba_only.float(), rtol=2**-7, atol=1e-5)
