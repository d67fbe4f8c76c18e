"""The C scores pass and work item of CPU decode attention (kernels/decode_scores_cpu.c); 8-bit caches' whole
kernel runs: test_decode_scores_cpu_8bit.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_factories import make_paged_kv, naive_attention

import pagedllm.kernels.paged_decode_attention_cpu as cpu_kernel
from pagedllm.kernels import decode_scores_cpu, paged_decode_attention_reference
from pagedllm.kernels.kv_quant import dequantize, quantize
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


def _float64_oracle(query, kv, scale):
    """Each sequence's attention in float64 over its own contiguous K/V (the cache's bfloat16 values)."""
    pairs = enumerate(zip(kv.keys, kv.values))
    return torch.stack([naive_attention(query[s : s + 1], k, v, scale)[0] for s, (k, v) in pairs])


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every float tensor ``torch.empty`` makes starts as NaN: an output element the kernel leaves unwritten shows."""
    real = torch.empty

    def empty(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", empty)


def _with_threads(threads, fn, *args):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(previous)


GQA = [(2, 1), (2, 2), (2, 7), (1, 8)]  # (kv_heads, group)
LENGTHS = {1: [[1], [37]], 16: [[1, 15, 16, 17, 33, 64, 100, 131, 7, 250, 2, 48, 49, 95, 160, 31]]}


@needs_kernel
@pytest.mark.parametrize("kv_heads,group", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("lens", LENGTHS[1] + LENGTHS[16], ids=lambda lens: f"batch{len(lens)}-{lens[-1]}")
def test_the_c_item_matches_float64(poisoned_outputs, monkeypatch, kv_heads, group, head_dim, block_size, lens):
    """Fresh random bfloat16 inputs, NaN in unused slots and junk table entries (make_paged_kv),
    contexts ending mid-block and of one token, batch 1 (KV heads split over items) and 16."""
    torch.manual_seed(len(lens) * 1000 + lens[-1] + head_dim + block_size + group)
    kv = make_paged_kv(lens, kv_heads, head_dim, block_size, torch.bfloat16, device="cpu")
    query = torch.randn(len(lens), kv_heads * group, head_dim).to(torch.bfloat16)
    paths = []
    real = decode_scores_cpu.c_path
    monkeypatch.setattr(decode_scores_cpu, "c_path", lambda *a: paths.append(real(*a)) or paths[-1])
    scale = head_dim**-0.5
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, scale)
    out = _with_threads(2, paged_decode_attention_cpu, *args)
    assert paths == [2] and out.dtype == torch.bfloat16
    # NOTE: float32 sums, the output rounded once to bfloat16 (half a unit in its last place)
    torch.testing.assert_close(out.double(), _float64_oracle(query, kv, scale), atol=2e-5, rtol=2**-8 + 1e-4)
    reference = paged_decode_attention_reference(*args)
    torch.testing.assert_close(out.float(), reference.float(), atol=2e-5, rtol=2**-7 + 1e-4)


FORMATS = {  # cache dtype -> (numpy view, k_scale, v_scale, e4m3's widening factor)
    torch.bfloat16: (torch.uint16, 1.0, 1.0, 1.0),
    torch.int8: (torch.int8, 1.0, 1.0, 1.0),
    torch.float8_e4m3fn: (torch.uint8, 0.37, 2.5, 256.0),
    torch.float8_e5m2: (torch.uint8, 3.0, 0.45, 1.0),
}


@needs_kernel
@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
@pytest.mark.parametrize("start,end", [(0, 1), (0, 37), (5, 70), (16, 48), (47, 83), (9, 9)])
def test_one_item_writes_every_output_element(dtype, start, end):
    """The C item of each cache format on its own (bfloat16 bits in and out), fp8 scales away from
    1 passed as the caller folds them: out starts as NaN; an empty range gives zeros."""
    torch.manual_seed(start + end)
    blocks, block_size, kv_heads, group, head_dim = 8, 16, 2, 7, 64
    view, k_scale, v_scale, factor = FORMATS[dtype]
    kc, vc = (quantize(torch.randn(blocks, block_size, kv_heads, head_dim), dtype, s) for s in (k_scale, v_scale))
    table = torch.randperm(blocks).to(torch.int32)
    q = torch.randn(kv_heads * group, head_dim).to(torch.bfloat16)
    out = torch.full((kv_heads * group, head_dim), float("nan"), dtype=torch.bfloat16)
    kn, vn, q16 = kc.view(view).numpy(), vc.view(view).numpy(), q.view(torch.uint16).numpy()
    scale, out_scale = 0.125 * k_scale * factor, v_scale * factor
    attend = decode_scores_cpu.attend_for(dtype)
    attend(q16, kn, vn, table.numpy(), start, end, 0, group, scale, 0.0, out_scale, out.view(torch.uint16).numpy())
    pos = torch.arange(start, end)
    slots = (table[pos // block_size].long(), pos % block_size)
    keys = dequantize(kc[slots], torch.float64, k_scale)  # [positions, kv_heads, head_dim]
    values = dequantize(vc[slots], torch.float64, v_scale)
    want = torch.zeros(kv_heads * group, head_dim, dtype=torch.float64)
    for h in range(kv_heads * group):
        if end > start:
            probs = torch.softmax(keys[:, h // group] @ q[h].double() * 0.125, dim=0)
            want[h] = probs @ values[:, h // group]
    torch.testing.assert_close(out.double(), want, rtol=2**-8 + 1e-5, atol=1e-5)  # NOTE: rounded once


@needs_kernel
def test_the_c_path_is_taken_where_it_applies():
    q, kc = torch.zeros(2, 14, 64, dtype=torch.bfloat16), torch.zeros(8, 16, 2, 64, dtype=torch.bfloat16)
    assert decode_scores_cpu.c_path(q, kc, kc, None) == 2
    assert decode_scores_cpu.c_path(q, kc, kc, 30.0) == 1  # NOTE: a soft-cap: only the scores in C
    assert decode_scores_cpu.c_path(q.float(), kc.float(), kc.float(), None) == 0
    assert decode_scores_cpu.c_path(q, kc[:, :8], kc[:, :8], None) == 0  # blocks of 8 slots
    assert decode_scores_cpu.c_path(q[..., :48], kc[..., :48], kc[..., :48], None) == 0  # rows not contiguous
    kernel = cpu_kernel._compiled_kernel(64, "widen", False, True, True, 2)
    assert kernel.py_func.__globals__["_attend"] is decode_scores_cpu.attend_for(torch.bfloat16)
    numba_only = cpu_kernel._compiled_kernel(64, "widen", False, True, True, 1)
    assert numba_only.py_func.__globals__["_attend"] is not decode_scores_cpu.attend_for(torch.bfloat16)
