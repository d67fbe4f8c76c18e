"""8-bit KV caches: the formats themselves, and every attention kernel over them against a
float64 oracle on the dequantized values.

Each kernel computes in float32 on exactly the values ``dequantize`` gives, so the
comparison is as tight as for a float32 cache. Unused cache slots are poisoned (NaN before
quantization: NaN scales in int8 rows, NaN or a huge value in fp8), outputs start as
garbage, and inputs are fresh random values per case.
"""

from __future__ import annotations

import pytest
import torch
from kernel_factories import DEVICE, make_paged_kv, naive_attention

import pagedllm.kernels as kernels
from pagedllm.kernels.kv_quant import (
    QUANT_DTYPES,
    dequantize,
    head_dim_of,
    quantize,
    raw,
    row_width,
)
from pagedllm.kernels.paged_decode_attention_cpu import HAS_NUMBA, paged_decode_attention_cpu

SCALES = {torch.float8_e4m3fn: (0.5, 0.25), torch.float8_e5m2: (2.0, 0.5), torch.int8: (1.0, 1.0)}
IDS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.int8: "int8"}
QDTYPES = [pytest.param(d, id=IDS[d]) for d in QUANT_DTYPES]


def _quantized_case(dtype, lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, window=None, seed=0):
    torch.manual_seed(seed)
    visible = None if window is None else [max(0, n - window) for n in lens]
    kv = make_paged_kv(lens, num_kv_heads, head_dim, block_size, torch.float32, device="cpu", visible_from=visible)
    k_scale, v_scale = SCALES[dtype]
    key_cache, value_cache = quantize(kv.key_cache, dtype, k_scale), quantize(kv.value_cache, dtype, v_scale)
    # the oracle's K/V: each sequence's rows as the cache holds them
    keys = [dequantize(quantize(k, dtype, k_scale), torch.float64, k_scale) for k in kv.keys]
    values = [dequantize(quantize(v, dtype, v_scale), torch.float64, v_scale) for v in kv.values]
    return kv, key_cache, value_cache, keys, values, (k_scale, v_scale)


def _decode_oracle(query, keys, values, scale, window=None):
    return torch.stack([naive_attention(q[None], k, v, scale, window)[0] for q, k, v in zip(query, keys, values)])


@pytest.mark.parametrize("dtype", QDTYPES)
def test_quantize_round_trip_error_is_what_the_format_promises(dtype):
    x = torch.randn(50, 4, 64) * torch.logspace(-3, 2, 50)[:, None, None]  # rows of very different sizes
    scale = 1.0 if dtype == torch.int8 else float(x.abs().max()) / torch.finfo(dtype).max
    rows = quantize(x, dtype, scale)
    assert rows.dtype == dtype and rows.shape[-1] == row_width(dtype, 64) and head_dim_of(rows) == 64
    err = (dequantize(rows, torch.float64, scale) - x.double()).abs()
    if dtype == torch.int8:  # per row: half a step of max|row| / 127, plus the float16 scale's rounding
        bound = x.abs().amax(-1, keepdim=True).double() * (0.5 / 127 + 2**-10)
        assert (err <= bound).all()
        assert (rows[..., :-2].abs() <= 127).all()
    else:  # relative to each value, above the subnormals
        mant = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]
        big = x.abs() > scale * 2**-5
        assert (err[big] <= x.abs()[big].double() * 2.0 ** -(mant + 1) * 1.0001).all()


@pytest.mark.parametrize("dtype", QDTYPES)
def test_reshape_and_cache_reference_writes_quantized_rows_and_skips_padding(dtype):
    torch.manual_seed(1)
    k_scale, v_scale = SCALES[dtype]
    key, value = torch.randn(5, 2, 32), torch.randn(5, 2, 32)
    shape = (4, 4, 2, row_width(dtype, 32))
    key_cache, value_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    slots = torch.tensor([3, 9, -1, 0, 14])
    kernels.reshape_and_cache_reference(key, value, key_cache, value_cache, slots, k_scale, v_scale)
    flat_k = raw(key_cache).view(16, 2, -1)
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep]], raw(quantize(key[keep], dtype, k_scale)))
    assert torch.equal(raw(value_cache).view(16, 2, -1)[slots[keep]], raw(quantize(value[keep], dtype, v_scale)))
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert not flat_k[untouched].any()


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("window", [None, 7])
def test_decode_reference_and_compiled_kernel_match_the_float64_oracle(dtype, window):
    lens = [1, 9, 30, 17]
    kv, key_cache, value_cache, keys, values, (ks, vs) = _quantized_case(dtype, lens, window=window, seed=2)
    query = torch.randn(len(lens), 4, 32)
    expected = _decode_oracle(query, keys, values, 0.3, window)
    args = (query, key_cache, value_cache, kv.block_tables, kv.context_lens, 0.3, window, None, ks, vs)
    ref = kernels.paged_decode_attention_reference(*args)
    torch.testing.assert_close(ref.double(), expected, atol=2e-5, rtol=1e-4)
    if HAS_NUMBA:
        out = paged_decode_attention_cpu(*args)
        assert not out.isnan().any()
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_compiled_kernel_over_an_8bit_cache_returns_the_querys_16bit_dtype(dtype):
    if not HAS_NUMBA:
        pytest.skip("numba is not installed")
    kv, key_cache, value_cache, keys, values, (ks, vs) = _quantized_case(dtype, [5, 40], seed=3)
    query = torch.randn(2, 4, 32).bfloat16()
    out = paged_decode_attention_cpu(
        query, key_cache, value_cache, kv.block_tables, kv.context_lens, 0.2, None, None, ks, vs
    )
    assert out.dtype == torch.bfloat16
    expected = _decode_oracle(query.double(), keys, values, 0.2)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_prefill_reference_matches_the_float64_oracle(dtype):
    lens = [12, 25]  # 12 new tokens of 12 (no prefix), 6 of 25
    kv, key_cache, value_cache, keys, values, (ks, vs) = _quantized_case(dtype, lens, seed=4)
    cu = torch.tensor([0, 12, 18], dtype=torch.int32)
    query = torch.randn(18, 4, 32)
    out = kernels.paged_prefill_attention_reference(
        query, None, None, key_cache, value_cache, kv.block_tables, cu, kv.context_lens, 0.25, None, None, ks, vs
    )
    for s in range(len(lens)):
        expected = naive_attention(query[cu[s] : cu[s + 1]], keys[s], values[s], 0.25)
        torch.testing.assert_close(out[cu[s] : cu[s + 1]].double(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_copy_blocks_moves_values_with_their_scales(dtype):
    caches = [quantize(torch.randn(6, 4, 2, 16), dtype) for _ in range(4)]
    before = [raw(c).clone() for c in caches]
    mapping = torch.tensor([[0, 3], [5, 1]])
    kernels.copy_blocks_reference(caches[:2], caches[2:], mapping)
    for cache, old in zip(caches, before):
        assert torch.equal(raw(cache)[3], old[0]) and torch.equal(raw(cache)[1], old[5])
        assert torch.equal(raw(cache)[[0, 2, 4, 5]], old[[0, 2, 4, 5]])


# -- Triton under the interpreter (or on CUDA) -------------------------------------------------------------


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("window", [None, 6])
def test_triton_decode_and_prefill_match_the_float64_oracle(dtype, window):
    if not kernels.HAS_TRITON:
        pytest.skip("triton is not installed")
    lens = [3, 21]
    kv, key_cache, value_cache, keys, values, (ks, vs) = _quantized_case(dtype, lens, window=window, seed=5)
    key_cache, value_cache = key_cache.to(DEVICE), value_cache.to(DEVICE)
    tables, ctx = kv.block_tables.to(DEVICE), kv.context_lens.to(DEVICE)
    query = torch.randn(2, 4, 32)
    out = kernels.paged_decode_attention(
        query.to(DEVICE), key_cache, value_cache, tables, ctx, 0.3, window, None, ks, vs
    )
    expected = _decode_oracle(query, keys, values, 0.3, window)
    torch.testing.assert_close(out.cpu().double(), expected, atol=2e-5, rtol=1e-4)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q = torch.randn(8, 4, 32)
    out = kernels.paged_prefill_attention(
        q.to(DEVICE), None, None, key_cache, value_cache, tables, cu.to(DEVICE), ctx, 0.3, window, None, ks, vs
    )
    for s in range(2):
        expected = naive_attention(q[cu[s] : cu[s + 1]], keys[s], values[s], 0.3, window)
        torch.testing.assert_close(out[cu[s] : cu[s + 1]].cpu().double(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_triton_reshape_and_cache_writes_what_the_reference_writes(dtype):
    if not kernels.HAS_TRITON:
        pytest.skip("triton is not installed")
    torch.manual_seed(6)
    ks, vs = SCALES[dtype]
    key, value = torch.randn(4, 2, 32), torch.randn(4, 2, 32)
    slots = torch.tensor([5, -1, 0, 11])
    shape = (3, 4, 2, row_width(dtype, 32))
    want = [torch.zeros(shape, dtype=dtype) for _ in range(2)]
    kernels.reshape_and_cache_reference(key, value, *want, slots, ks, vs)
    got = [torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in range(2)]
    kernels.reshape_and_cache(key.to(DEVICE), value.to(DEVICE), *got, slots.to(DEVICE), ks, vs)
    for g, w in zip(got, want):
        assert torch.equal(raw(g).cpu(), raw(w))


@pytest.mark.parametrize("dtype", QDTYPES)
def test_triton_copy_blocks_moves_values_with_their_scales(dtype):
    if not kernels.HAS_TRITON:
        pytest.skip("triton is not installed")
    caches = [quantize(torch.randn(6, 4, 2, 16), dtype).to(DEVICE) for _ in range(2)]
    before = [raw(c).cpu().clone() for c in caches]
    kernels.copy_blocks(caches[:1], caches[1:], torch.tensor([[0, 3], [5, 1]], device=DEVICE))
    for cache, old in zip(caches, before):
        assert torch.equal(raw(cache).cpu()[3], old[0]) and torch.equal(raw(cache).cpu()[1], old[5])
