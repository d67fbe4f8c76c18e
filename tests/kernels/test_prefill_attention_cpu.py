"""The C prefill attention over a bfloat16 or 8-bit paged cache (kernels/prefill_attention_cpu.py)
against its float64 reference (on the dequantized cache), on fresh random caches with junk
wherever it must not be read."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import prefill_attention_cpu as kernel
from pagedllm.kernels.kv_quant import quantize, raw
from pagedllm.kernels.prefill_attention_cpu import (
    applies,
    prefill_attention_cpu,
    prefill_attention_cpu_reference,
)

needs_kernel = pytest.mark.skipif(
    not kernel.available(), reason="needs an x86-64 CPU with AVX-512-BF16, numba and a C compiler"
)

# NOTE: the kernel sums in float32 and rounds each output once to bfloat16: within one
# bfloat16 rounding of the float64 reference (the tolerance the 16-bit kernel tests use).
BF16_ROUNDING = dict(atol=2e-5, rtol=2**-8 + 1e-4)
JUNK_BLOCK = 0
"""A cache block of NaNs: table entries the kernel must not follow (freed, before the window) point to it."""
JUNK_BYTE = 0x7F
"""What 8-bit junk rows hold: NaN in e5m2 and in an int8 row's float16 scale (0x7F7F), e4m3's
NaN pattern (which the kernel would read as 480, far outside the values)."""
EIGHT_BIT = {  # cache dtype -> (k_scale, v_scale): fp8's per-tensor scales away from 1 to check their folding
    torch.int8: (1.0, 1.0),
    torch.float8_e4m3fn: (0.5, 2.0),
    torch.float8_e5m2: (2.0, 0.25),
}


def as_cache(values, dtype, scale):
    """float32 cache ``values`` as a ``dtype`` cache (rows quantized); NaN rows become junk."""
    if dtype == torch.bfloat16:
        return values.to(torch.bfloat16)
    junk = values.isnan().any(-1)
    rows = quantize(values.nan_to_num(), dtype, scale)
    raw(rows)[junk] = JUNK_BYTE
    return rows


def make_step(chunks, kv_heads, group, head_dim, block_size, window, seed, dtype=torch.bfloat16, scales=(1.0, 1.0)):
    """Caches of ``dtype``, tables and query for ``chunks`` of (cached prefix, new tokens): every
    position of a context holds random values, positions past it junk (NaN), blocks before the
    window the junk block."""
    gen = torch.Generator().manual_seed(seed)
    lens = [p + q for p, q in chunks]
    widths = [-(-n // block_size) for n in lens]
    num_blocks = 1 + sum(widths) + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [torch.full(shape, float("nan")) for _ in range(2)]
    tables = torch.full((len(chunks), max(widths) + 2), JUNK_BLOCK, dtype=torch.int32)
    free = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()
    for s, n in enumerate(lens):
        for b in range(widths[s]):
            tables[s, b] = block = free.pop()
            used = min(block_size, n - b * block_size)
            for cache in caches:
                cache[block, :used] = torch.randn(used, kv_heads, head_dim, generator=gen)
        if window is not None:  # blocks wholly before the first new token's window are gone
            first = max(0, n - chunks[s][1] - window + 1)
            tables[s, : first // block_size] = JUNK_BLOCK
    rows = [0]
    for _, q in chunks:
        rows.append(rows[-1] + q)
    spans = [(rows[s], rows[s + 1], n) for s, n in enumerate(lens)]
    query = torch.randn(rows[-1], kv_heads * group, head_dim, generator=gen).to(torch.bfloat16)
    key_cache, value_cache = (as_cache(c, dtype, s) for c, s in zip(caches, scales))
    return query, key_cache, value_cache, tables, spans


def check(chunks, kv_heads, group, head_dim, block_size, window, seed=0, dtype=torch.bfloat16):
    k_scale, v_scale = EIGHT_BIT.get(dtype, (1.0, 1.0))
    query, key_cache, value_cache, tables, spans = make_step(
        chunks, kv_heads, group, head_dim, block_size, window, seed, dtype, (k_scale, v_scale)
    )
    scale, scales = head_dim**-0.5, dict(k_scale=k_scale, v_scale=v_scale)
    out = torch.full_like(query, float("nan"))  # NOTE: poisoned: every row must be written
    got = prefill_attention_cpu(query, key_cache, value_cache, tables, spans, scale, window, out=out, **scales)
    assert got is out and not got.isnan().any()
    want = prefill_attention_cpu_reference(query, key_cache, value_cache, tables, spans, scale, window, **scales)
    torch.testing.assert_close(got.double(), want, **BF16_ROUNDING)


@needs_kernel
@pytest.mark.parametrize("q_len", [1, 17, 64, 300])
@pytest.mark.parametrize("prefix", [0, 45])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (2, 128), (7, 64), (7, 128), (2, 64)])
def test_matches_float64_reference(q_len, prefix, block_size, group, head_dim):
    check([(prefix, q_len)], 2, group, head_dim, block_size, None, seed=q_len + prefix + block_size + group)


@needs_kernel
@pytest.mark.parametrize("window", [1, 16, 40, 333])
@pytest.mark.parametrize("q_len,prefix", [(1, 100), (17, 0), (64, 70), (300, 0), (300, 45)])
def test_sliding_window_matches_float64_reference(window, q_len, prefix):
    check([(prefix, q_len)], 2, 7, 64, 16, window, seed=window + q_len)


@needs_kernel
@pytest.mark.parametrize("window", [None, 24])
def test_several_chunks_in_one_call(window):
    check([(0, 33), (90, 5), (0, 1), (17, 130)], 2, 7, 64, 16, window, seed=5)
    check([(50, 70), (0, 200)], 1, 2, 256, 32, window, seed=6)


@needs_kernel
@pytest.mark.parametrize("dtype", list(EIGHT_BIT))
@pytest.mark.parametrize("q_len,prefix", [(1, 45), (17, 0), (64, 70), (300, 45)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (7, 64), (2, 128)])
def test_8bit_caches_match_float64_reference(dtype, q_len, prefix, block_size, group, head_dim):
    """K widened to bfloat16, int8 row scales on scores and V, fp8 scales folded: within one
    bfloat16 rounding of the float64 attention over the dequantized cache."""
    check([(prefix, q_len)], 2, group, head_dim, block_size, None, seed=q_len + group, dtype=dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", list(EIGHT_BIT))
@pytest.mark.parametrize("window", [1, 40])
def test_8bit_caches_with_a_window_and_several_chunks(dtype, window):
    check([(100, 1), (17, 130), (0, 33)], 2, 7, 64, 16, window, seed=window, dtype=dtype)
    check([(50, 70), (0, 200)], 1, 2, 256, 32, None, seed=6, dtype=dtype)


@needs_kernel
def test_rows_outside_the_chunks_and_strided_queries():
    query, key_cache, value_cache, tables, spans = make_step([(10, 20), (0, 9)], 2, 4, 64, 16, None, 3)
    wide = torch.randn(query.shape[0] + 2, 3 * query.shape[1], 64).to(torch.bfloat16)  # q of a fused qkv
    q = wide[1:-1, : query.shape[1]]
    q.copy_(query)
    assert not q.is_contiguous()
    out = torch.full((q.shape[0], *q.shape[1:]), float("nan"), dtype=torch.bfloat16)
    only_second = [spans[1]]
    prefill_attention_cpu(q, key_cache, value_cache, tables[1:], only_second, 0.125, out=out)
    want = prefill_attention_cpu_reference(query, key_cache, value_cache, tables[1:], only_second, 0.125)
    start, end, _ = spans[1]
    assert out[:start].isnan().all() and not out[start:end].isnan().any()
    torch.testing.assert_close(out[start:end].double(), want[start:end], **BF16_ROUNDING)


@needs_kernel
def test_applies_to_bfloat16_shapes_it_handles_only():
    q, cache = torch.zeros(3, 14, 64, dtype=torch.bfloat16), torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    assert applies(q, cache)
    assert not applies(q, cache, logit_softcap=30.0)
    assert not applies(q.float(), cache.float()) and not applies(q.half(), cache.half())
    int8 = torch.zeros(4, 16, 2, 66, dtype=torch.int8)  # rows of 64 values and their scale
    assert applies(q, int8) and applies(q, cache.to(torch.float8_e4m3fn)) and applies(q, cache.to(torch.float8_e5m2))
    assert not applies(q, int8[..., :64]) and not applies(q.float(), int8)  # a row without its scale; float32 q
    for head_dim in (32, 96, 320):
        assert not applies(q.new_zeros(3, 14, head_dim), cache.new_zeros(4, 16, 2, head_dim))
    assert not applies(q, cache[:, :8])  # blocks of 8
    with pytest.raises(ValueError, match="bfloat16"):
        prefill_attention_cpu(q.float(), cache.float(), cache.float(), torch.zeros(1, 1, dtype=torch.int32), [], 1.0)
    with pytest.raises(ValueError, match="positive scale"):
        prefill_attention_cpu(q, cache, cache, torch.zeros(1, 4, dtype=torch.int32), [(0, 3, 3)], -1.0)
    fp8 = cache.to(torch.float8_e5m2)
    with pytest.raises(ValueError, match="positive scale"):  # an fp8 cache's k_scale is in the score scale
        prefill_attention_cpu(q, fp8, fp8, torch.zeros(1, 4, dtype=torch.int32), [(0, 3, 3)], 1.0, k_scale=0.0)
    with pytest.raises(ValueError, match="value cache torch.float8_e4m3fn"):  # K and V of one format
        prefill_attention_cpu(q, fp8, cache.to(torch.float8_e4m3fn), torch.zeros(1, 4, dtype=torch.int32), [], 1.0)
    with pytest.raises(ValueError, match="chunk 0"):
        prefill_attention_cpu(q, cache, cache, torch.zeros(1, 4, dtype=torch.int32), [(0, 3, 2)], 1.0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_two_threads_share_the_items_and_agree_with_one(dtype):
    query, key_cache, value_cache, tables, spans = make_step([(0, 150), (40, 30)], 2, 7, 64, 16, None, 8, dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = prefill_attention_cpu(query, key_cache, value_cache, tables, spans, 0.125)
        torch.set_num_threads(2)
        two = prefill_attention_cpu(query, key_cache, value_cache, tables, spans, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # NOTE: each row's sums run in the same order on any thread


def test_items_are_dealt_once_each_and_evenly():
    items = kernel._work_items([(0, 300, 300), (300, 317, 400)], 2, 7, 2)
    assert set(items[:, 5].tolist()) == {0, 1} and (items[:, 4] > items[:, 3]).all()
    covered = sorted((int(c), int(t)) for c, _, _, t0, t1, _ in items for t in range(t0, t1))
    assert covered == sorted([(0, t) for t in range(300)] * 2 + [(1, t) for t in range(17)] * 2)
    plan = kernel._deal(items, 2, 0)
    dealt = sorted(plan[0, 1 : 1 + plan[0, 0]].tolist() + plan[1, 1 : 1 + plan[1, 0]].tolist())
    assert dealt == list(range(len(items)))
    cost = (items[:, 4] - items[:, 3]) * (items[:, 2] + (items[:, 3] + items[:, 4]) // 2 + 17)
    loads = [cost[plan[t, 1 : 1 + plan[t, 0]]].sum() for t in range(2)]
    assert max(loads) <= 1.1 * min(loads)
