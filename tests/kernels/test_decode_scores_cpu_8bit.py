"""The C decode work item over 8-bit caches (int8 rows with their scale, fp8 e4m3 / e5m2 with
per-tensor scales away from 1), through the whole CPU kernel, against float64 attention on the
values ``kv_quant.dequantize`` gives; and which path each input takes."""

from __future__ import annotations

import pytest
import torch
from kernel_factories import make_paged_kv, naive_attention
from test_decode_scores_cpu import GQA, LENGTHS, _with_threads, needs_kernel, poisoned_outputs  # noqa: F401

import pagedllm.kernels.paged_decode_attention_cpu as cpu_kernel
from pagedllm.kernels import decode_scores_cpu
from pagedllm.kernels.kv_quant import dequantize, quantize
from pagedllm.kernels.paged_decode_attention_cpu import paged_decode_attention_cpu

SCALES = {torch.int8: (1.0, 1.0), torch.float8_e4m3fn: (0.37, 2.5), torch.float8_e5m2: (3.0, 0.45)}
DTYPES = [pytest.param(d, id=str(d).split(".")[1]) for d in SCALES]


def _quantized(lens, kv_heads, head_dim, block_size, dtype):
    """A paged case whose caches hold ``dtype``: slots past each context hold random bytes (huge,
    NaN or infinite values and scales) and table entries past it are huge ids."""
    kv = make_paged_kv(lens, kv_heads, head_dim, block_size, torch.float32, device="cpu")
    k_scale, v_scale = SCALES[dtype]
    key_cache, value_cache = quantize(kv.key_cache, dtype, k_scale), quantize(kv.value_cache, dtype, v_scale)
    unused = kv.key_cache.isnan().all(-1).all(-1)  # [blocks, slots]: make_paged_kv's NaN slots
    for cache in (key_cache, value_cache):
        junk = torch.randint(0, 256, cache[unused].shape, dtype=torch.uint8)
        cache.view(torch.uint8)[unused] = junk
    keys = [dequantize(quantize(k, dtype, k_scale), torch.float64, k_scale) for k in kv.keys]
    values = [dequantize(quantize(v, dtype, v_scale), torch.float64, v_scale) for v in kv.values]
    return kv, key_cache, value_cache, keys, values


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,group", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("lens", LENGTHS[1] + LENGTHS[16], ids=lambda lens: f"batch{len(lens)}-{lens[-1]}")
def test_the_c_item_over_an_8bit_cache_matches_float64(
    poisoned_outputs,  # noqa: F811
    monkeypatch,
    dtype,
    kv_heads,
    group,
    head_dim,
    block_size,
    lens,
):
    """Contexts ending mid-block and of one token, batch 1 (KV heads split over items) and 16."""
    torch.manual_seed(len(lens) * 1000 + lens[-1] + head_dim + block_size + group)
    kv, key_cache, value_cache, keys, values = _quantized(lens, kv_heads, head_dim, block_size, dtype)
    query = torch.randn(len(lens), kv_heads * group, head_dim).to(torch.bfloat16)
    paths = []
    real = decode_scores_cpu.c_path
    monkeypatch.setattr(decode_scores_cpu, "c_path", lambda *a: paths.append(real(*a)) or paths[-1])
    scale = head_dim**-0.5
    args = (query, key_cache, value_cache, kv.block_tables, kv.context_lens, scale, None, None, *SCALES[dtype])
    out = _with_threads(2, paged_decode_attention_cpu, *args)
    assert paths == [2] and out.dtype == torch.bfloat16
    want = torch.stack(
        [naive_attention(query[s : s + 1].double(), keys[s], values[s], scale)[0] for s in range(len(lens))]
    )
    # NOTE: float32 sums on exactly the dequantized values, the output rounded once to bfloat16
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2**-8 + 1e-4)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_which_path_an_8bit_cache_takes(dtype):
    """A bfloat16 query: the C item; a soft-cap, a float32 or float16 query, or sizes it does not
    take: the Numba kernel (the C scores pass reads bfloat16 caches only)."""
    q = torch.zeros(2, 14, 64, dtype=torch.bfloat16)
    kc = quantize(torch.zeros(8, 16, 2, 64), dtype)
    assert decode_scores_cpu.c_path(q, kc, kc, None) == 2
    assert decode_scores_cpu.c_path(q, kc, kc, 30.0) == 0
    assert decode_scores_cpu.c_path(q.float(), kc, kc, None) == 0
    assert decode_scores_cpu.c_path(q.half(), kc, kc, None) == 0
    assert decode_scores_cpu.c_path(q, kc[:, :8], kc[:, :8], None) == 0  # blocks of 8 slots
    gaps = quantize(torch.zeros(8, 16, 2, 128), dtype)[..., : kc.shape[-1]]  # rows 128 apart: not contiguous
    assert decode_scores_cpu.c_path(q, gaps, gaps, None) == 0
    int8 = dtype == torch.int8
    widening = "widen" if int8 else "widen_e4m3" if dtype == torch.float8_e4m3fn else "widen_e5m2"
    kernel = cpu_kernel._compiled_kernel(64, widening, int8, True, True, 2)
    assert kernel.py_func.__globals__["_attend"] is decode_scores_cpu.attend_for(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_soft_cap_over_an_8bit_cache_runs_in_numba_and_agrees(dtype):
    torch.manual_seed(5)
    kv, key_cache, value_cache, keys, values = _quantized([5, 40, 77], 2, 64, 16, dtype)
    query = torch.randn(3, 14, 64).to(torch.bfloat16)
    args = (query, key_cache, value_cache, kv.block_tables, kv.context_lens, 0.125, None, 5.0, *SCALES[dtype])
    out = paged_decode_attention_cpu(*args)
    want = torch.stack(
        [naive_attention(query[s : s + 1].double(), keys[s], values[s], 0.125, None, 5.0)[0] for s in range(3)]
    )
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2**-8 + 1e-4)
