"""The CPU backends (torch ops, the compiled decode kernel) against the kernels' references, on random caches."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.kernels import (
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
    reshape_and_cache_reference,
)
from pagedllm.kernels import prefill_attention_cpu as c_prefill
from pagedllm.kernels.kv_quant import KVScales
from pagedllm.server.worker import cpu_attention
from pagedllm.server.worker.attention import select_attention_ops
from pagedllm.server.worker.cpu_attention import (
    _group_bounds,
    compiled_decode_attention,
    decode_attention,
    plan_attention,
    prefill_attention,
    write_kv,
)

HEADS = [(1, 1), (4, 4), (4, 2), (6, 2), (8, 1), (16, 2)]  # (num_heads, num_kv_heads): MHA, GQA, MQA


def random_cache(num_blocks, block_size, kv_heads, head_dim, gen):
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def random_tables(lens, block_size, num_blocks, gen, garbage=True, visible_from=None):
    """Distinct physical blocks per sequence; entries past a sequence's last block are junk,
    and so are those of blocks wholly before ``visible_from[s]`` (freed, out of the window)."""
    width = max(-(-n // block_size) for n in lens) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    fill = 10**6 if garbage else 0
    tables = torch.full((len(lens), width), fill, dtype=torch.int32)
    used = 0
    for s, n in enumerate(lens):
        k = -(-n // block_size)
        tables[s, :k] = perm[used : used + k].int()
        used += k
    for s, first in enumerate(visible_from or []):
        tables[s, : first // block_size] = 10**6
    return tables


WINDOWS = st.one_of(st.none(), st.just(1), st.integers(1, 100))
SOFTCAPS = st.sampled_from([None, 0.5, 30.0])


def empty_prefill(device="cpu"):
    return (
        torch.zeros(0, 0, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
    )


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 150), min_size=1, max_size=12),
    block_size=st.sampled_from([1, 4, 16, 32]),
    heads=st.sampled_from(HEADS),
    head_dim=st.sampled_from([8, 64]),
    seed=st.integers(0, 2**16),
    window=WINDOWS,
    softcap=SOFTCAPS,
)
def test_decode_matches_reference(lens, block_size, heads, head_dim, seed, window, softcap):
    """Grouped torch decode and the compiled kernel, with or without a window (the blocks
    before it junk in the table) and soft-capping, against the reference."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, kv_heads = heads
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    key_cache, value_cache = random_cache(num_blocks, block_size, kv_heads, head_dim, gen)
    visible_from = None if window is None else [max(0, n - window) for n in lens]
    tables = random_tables(lens, block_size, num_blocks, gen, visible_from=visible_from)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    plan = plan_attention(tables, context_lens, *empty_prefill(), block_size, compiled_decode=True)
    ref = paged_decode_attention_reference(query, key_cache, value_cache, tables, context_lens, scale, window, softcap)
    out = decode_attention(query, key_cache, value_cache, plan, scale, window, softcap)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    out = compiled_decode_attention(query, key_cache, value_cache, plan, scale, window, softcap)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_one_plan_serves_layers_with_different_windows():
    """Each window gets its own groups, built once per step: a windowed row reads only its window's blocks."""
    lens = [300, 17, 100]
    tables = random_tables(lens, 16, 40, torch.Generator().manual_seed(0), garbage=False)
    plan = plan_attention(tables, torch.tensor(lens, dtype=torch.int32), *empty_prefill(), 16)
    full, windowed = plan.grouped(None), plan.grouped(40)
    assert plan.grouped(40) is windowed and plan.grouped(None) is full
    assert [g.length for g in full.groups] == [32, 112, 304]
    # window 40: 300 -> positions 260..299 (blocks 16..18), 17 -> 0..16 (0..1), 100 -> 60..99 (3..6);
    # one group of 4 blocks per row, the shorter rows padded with their first visible block
    assert windowed.order is not None and windowed.order.tolist() == [1, 0, 2]
    assert [g.length for g in windowed.groups] == [64]
    t = tables.tolist()
    expected = [t[1][c] for c in (0, 1, 0, 0)] + [t[0][c] for c in (16, 17, 18, 16)] + [t[2][c] for c in (3, 4, 5, 6)]
    assert windowed.groups[0].block_index.tolist() == expected
    mask = windowed.groups[0].mask
    assert mask is not None
    assert mask[:, 0, 0].sum(dim=1).tolist() == [17, 40, 40]  # visible positions per row
    assert mask[1, 0, 0].nonzero().view(-1).tolist() == list(range(260 - 256, 300 - 256))


def test_decode_groups_are_sorted_and_padding_is_bounded():
    lens = [300, 17, 16, 1, 160, 150, 33, 900]
    tables = random_tables(lens, 16, 200, torch.Generator().manual_seed(0), garbage=False)
    grouped = plan_attention(tables, torch.tensor(lens, dtype=torch.int32), *empty_prefill(), 16).grouped()
    order = grouped.order
    assert order is not None and order.tolist() == sorted(range(len(lens)), key=lambda i: -(-lens[i] // 16))
    covered = [i for g in grouped.groups for i in range(g.rows.start, g.rows.stop)]
    assert covered == list(range(len(lens)))
    assert [g.length for g in grouped.groups] == [48, 160, 304, 912]


def test_sorted_decodes_need_no_reordering():
    plan = plan_attention(
        torch.zeros(3, 4, dtype=torch.int32), torch.tensor([1, 2, 40], dtype=torch.int32), *empty_prefill(), 16
    )
    assert plan.grouped().order is None
    assert plan.grouped().groups[0].mask is not None


def test_group_bounds_merge_close_lengths_only():
    assert _group_bounds([1, 2, 3, 4, 10, 10, 100, 110], 16, 32) == [(0, 3), (3, 4), (4, 6), (6, 8)]
    assert _group_bounds([5], 1, 32) == [(0, 1)]
    assert _group_bounds([], 16, 32) == []


@settings(max_examples=30, deadline=None)
@given(
    chunks=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 40)), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 4, 16]),
    heads=st.sampled_from(HEADS),
    seed=st.integers(0, 2**16),
    window=WINDOWS,
    softcap=SOFTCAPS,
)
def test_prefill_matches_reference(chunks, block_size, heads, seed, window, softcap):
    """(prefix, new tokens) per sequence: no prefix reads the new K/V, a prefix reads the
    cache (from the first new token's window on: the blocks before it are junk in the table)."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, kv_heads = heads
    head_dim = 16
    lens = [max(1, p + q) for p, q in chunks]
    q_lens = [min(q, n) for (_, q), n in zip(chunks, lens)]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    key_cache, value_cache = random_cache(num_blocks, block_size, kv_heads, head_dim, gen)
    visible_from = None if window is None else [max(0, n - q + 1 - window) for n, q in zip(lens, q_lens)]
    tables = random_tables(lens, block_size, num_blocks, gen, garbage=False, visible_from=visible_from)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    query = torch.randn(total, num_heads, head_dim, generator=gen)
    key = torch.randn(total, kv_heads, head_dim, generator=gen)
    value = torch.randn(total, kv_heads, head_dim, generator=gen)
    slots = [
        int(tables[s, p // block_size]) * block_size + p % block_size
        for s, (n, q) in enumerate(zip(lens, q_lens))
        for p in range(n - q, n)
    ]  # NOTE: new tokens are always inside their own window, so their table entries are live
    reshape_and_cache_reference(key, value, key_cache, value_cache, torch.tensor(slots, dtype=torch.int64))
    context_lens = torch.tensor(lens, dtype=torch.int32)
    plan = plan_attention(
        torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), tables, cu, context_lens, block_size
    )
    scale = head_dim**-0.5
    out = prefill_attention(query, key, value, key_cache, value_cache, plan, scale, window, softcap)
    ref = paged_prefill_attention_reference(
        query, key, value, key_cache, value_cache, tables, cu, context_lens, scale, window, softcap
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_write_kv_matches_reference():
    gen = torch.Generator().manual_seed(3)
    caches = [torch.zeros(6, 4, 2, 8) for _ in range(4)]
    key, value = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([0, 7, 9, 23, 12])
    write_kv(key, value, caches[0], caches[1], slots)
    reshape_and_cache_reference(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_compiled_plan_sends_whole_decode_rows_to_the_kernel():
    gen = torch.Generator().manual_seed(3)
    lens = [300, 17, 1, 160]
    key_cache, value_cache = random_cache(40, 16, 2, 32, gen)
    tables = random_tables(lens, 16, 40, gen)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(len(lens), 8, 32, generator=gen)
    plan = plan_attention(tables, context_lens, *empty_prefill(), 16, compiled_decode=True)
    assert plan.compiled is not None
    out = compiled_decode_attention(query, key_cache, value_cache, plan, 0.2)
    grouped = decode_attention(
        query, key_cache, value_cache, plan_attention(tables, context_lens, *empty_prefill(), 16), 0.2
    )
    torch.testing.assert_close(out, grouped, atol=2e-5, rtol=1e-4)


def test_backend_choice_on_cpu():
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert select_attention_ops("auto", cpu, dtype).name == "numba"
    assert select_attention_ops("torch", cpu, torch.bfloat16).name == "torch"
    with pytest.raises(ValueError, match="'numba' runs float32, bfloat16, float16 on the CPU, not torch.float64"):
        select_attention_ops("numba", cpu, torch.float64)


# NOTE: the torch path computes in the 16-bit dtype (SDPA accumulates in float32 inside, but
# soft-capped scores are rounded to it), so it gets the kernels' usual 16-bit tolerance; the
# compiled kernel computes in float32 and rounds only its output.
TORCH_16_BIT = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=3e-3, rtol=1e-2)}
KERNEL_16_BIT = {torch.bfloat16: dict(atol=2e-5, rtol=2**-8 + 1e-4), torch.float16: dict(atol=2e-5, rtol=2**-11 + 1e-4)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 30.0), (7, 0.5)])
def test_16_bit_attention_matches_the_float32_reference(dtype, window, softcap):
    """A step of decodes and prefill chunks (with and without a cached prefix) in a 16-bit
    dtype, against the references in float32 on the same 16-bit values."""
    gen = torch.Generator().manual_seed(11)
    block_size, num_heads, kv_heads, head_dim = 8, 8, 2, 32
    decode_lens, chunks = [1, 45, 130], [(0, 37), (50, 21)]  # chunks: (cached prefix, new tokens)
    prefill_lens = [p + q for p, q in chunks]
    num_blocks = sum(-(-n // block_size) for n in decode_lens + prefill_lens) + 2
    key_cache, value_cache = (c.to(dtype) for c in random_cache(num_blocks, block_size, kv_heads, head_dim, gen))
    tables = random_tables(decode_lens + prefill_lens, block_size, num_blocks, gen, garbage=False)
    decode_tables, prefill_tables = tables[: len(decode_lens)], tables[len(decode_lens) :]
    decode_context = torch.tensor(decode_lens, dtype=torch.int32)
    prefill_context = torch.tensor(prefill_lens, dtype=torch.int32)
    cu = torch.tensor([0, chunks[0][1], chunks[0][1] + chunks[1][1]], dtype=torch.int32)
    query = torch.randn(len(decode_lens) + int(cu[-1]), num_heads, head_dim, generator=gen).to(dtype)
    key, value = (torch.randn(int(cu[-1]), kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    slots = [
        int(prefill_tables[s, p // block_size]) * block_size + p % block_size
        for s, (c, q) in enumerate(chunks)
        for p in range(c, c + q)
    ]
    write_kv(key, value, key_cache, value_cache, torch.tensor(slots))
    plan = plan_attention(
        decode_tables, decode_context, prefill_tables, cu, prefill_context, block_size, compiled_decode=True
    )
    scale = head_dim**-0.5
    d = len(decode_lens)
    kc, vc = key_cache.float(), value_cache.float()
    decode_ref = paged_decode_attention_reference(
        query[:d].float(), kc, vc, decode_tables, decode_context, scale, window, softcap
    )
    prefill_ref = paged_prefill_attention_reference(
        query[d:].float(),
        key.float(),
        value.float(),
        kc,
        vc,
        prefill_tables,
        cu,
        prefill_context,
        scale,
        window,
        softcap,
    )
    outputs = {
        "compiled decode": (
            compiled_decode_attention(query[:d], key_cache, value_cache, plan, scale, window, softcap),
            decode_ref,
            KERNEL_16_BIT,
        ),
        "torch decode": (
            decode_attention(query[:d], key_cache, value_cache, plan, scale, window, softcap),
            decode_ref,
            TORCH_16_BIT,
        ),
        "torch prefill": (
            prefill_attention(query[d:], key, value, key_cache, value_cache, plan, scale, window, softcap),
            prefill_ref,
            TORCH_16_BIT,
        ),
    }
    for name, (out, ref, tolerance) in outputs.items():
        assert out.dtype == dtype, name
        torch.testing.assert_close(out.float(), ref, **tolerance[dtype], msg=lambda m, name=name: f"{name}: {m}")


def _new_token_slots(tables: torch.Tensor, chunks: list[tuple[int, int]], block_size: int) -> torch.Tensor:
    """The cache slots of each chunk's new tokens (chunks: (cached prefix, new tokens))."""
    return torch.tensor([
        int(tables[s, p // block_size]) * block_size + p % block_size
        for s, (c, q) in enumerate(chunks)
        for p in range(c, c + q)
    ])  # fmt: skip


def _prefill_plan(tables, cu, context, block_size):
    """The attention plan of a prompt-only step."""
    no_decodes = torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    return plan_attention(*no_decodes, tables, cu, context, block_size)


def _count_c_prefill_calls(monkeypatch) -> list:
    """A list that grows by one each time cpu_attention calls the C prefill kernel."""
    calls: list[int] = []
    kernel = c_prefill.prefill_attention_cpu
    monkeypatch.setattr(cpu_attention, "prefill_attention_cpu", lambda *a: calls.append(1) or kernel(*a))
    return calls


@pytest.mark.skipif(not c_prefill.available(), reason="needs the C prefill attention (AVX-512-BF16)")
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 30.0)])
def test_bfloat16_prefill_takes_the_c_kernel_where_it_applies(monkeypatch, window, softcap):
    """bfloat16 chunks with and without a cached prefix: the C kernel reads them from the cache
    (soft-capped ones stay on SDPA), within one bfloat16 rounding of the float32 reference."""
    gen = torch.Generator().manual_seed(12)
    block_size, num_heads, kv_heads, head_dim = 16, 14, 2, 64
    chunks = [(0, 37), (50, 21), (0, 1)]  # (cached prefix, new tokens)
    lens = [p + q for p, q in chunks]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    key_cache, value_cache = (c.bfloat16() for c in random_cache(num_blocks, block_size, kv_heads, head_dim, gen))
    tables = random_tables(lens, block_size, num_blocks, gen, garbage=False)
    cu = torch.tensor([0, *torch.tensor([q for _, q in chunks]).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen).bfloat16()
    key, value = (torch.randn(int(cu[-1]), kv_heads, head_dim, generator=gen).bfloat16() for _ in range(2))
    slots = _new_token_slots(tables, chunks, block_size)
    write_kv(key, value, key_cache, value_cache, slots)
    context = torch.tensor(lens, dtype=torch.int32)
    plan = _prefill_plan(tables, cu, context, block_size)
    calls = _count_c_prefill_calls(monkeypatch)
    scale = head_dim**-0.5
    out = prefill_attention(query, key, value, key_cache, value_cache, plan, scale, window, softcap)
    assert len(calls) == (softcap is None)
    ref = paged_prefill_attention_reference(
        query.float(), key.float(), value.float(), key_cache.float(), value_cache.float(),
        tables, cu, context, scale, window, softcap,
    )  # fmt: skip
    tolerance = KERNEL_16_BIT if softcap is None else TORCH_16_BIT
    torch.testing.assert_close(out.float(), ref, **tolerance[torch.bfloat16])


@pytest.mark.skipif(not c_prefill.available(), reason="needs the C prefill attention (AVX-512-BF16)")
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("window", [None, 20])
def test_bfloat16_prefill_over_an_8bit_cache_takes_the_c_kernel(monkeypatch, cache_dtype, window):
    """Chunks with and without a cached prefix, K/V written quantized: the C kernel reads every
    chunk from the cache (fp8 scales passed on), within one bfloat16 rounding of the float32
    reference over the cache; a soft-capped or float32 query stays on SDPA."""
    gen = torch.Generator().manual_seed(13)
    block_size, num_heads, kv_heads, head_dim = 16, 14, 2, 64
    chunks = [(0, 37), (50, 21), (0, 1)]  # (cached prefix, new tokens)
    lens = [p + q for p, q in chunks]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    width = head_dim + 2 if cache_dtype == torch.int8 else head_dim
    key_cache, value_cache = (torch.zeros(num_blocks, block_size, kv_heads, width, dtype=cache_dtype) for _ in "kv")
    tables = random_tables(lens, block_size, num_blocks, gen, garbage=False)
    cu = torch.tensor([0, *torch.tensor([q for _, q in chunks]).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen).bfloat16()
    scales = KVScales(0.5, 2.0) if cache_dtype != torch.int8 else KVScales()
    prefix = sum(([int(tables[s, p // block_size]) * block_size + p % block_size] for s, (c, _) in enumerate(chunks)
                  for p in range(c)), [])  # fmt: skip
    write_kv(*(torch.randn(len(prefix), kv_heads, head_dim, generator=gen) for _ in "kv"),
             key_cache, value_cache, torch.tensor(prefix, dtype=torch.int64), scales)  # fmt: skip
    slots = _new_token_slots(tables, chunks, block_size)
    key, value = (torch.randn(int(cu[-1]), kv_heads, head_dim, generator=gen).bfloat16() for _ in range(2))
    write_kv(key, value, key_cache, value_cache, slots, scales)
    context = torch.tensor(lens, dtype=torch.int32)
    plan = _prefill_plan(tables, cu, context, block_size)
    calls = _count_c_prefill_calls(monkeypatch)
    scale = head_dim**-0.5
    out = prefill_attention(query, key, value, key_cache, value_cache, plan, scale, window, None, scales)
    assert len(calls) == 1 and out.dtype == torch.bfloat16
    ref = paged_prefill_attention_reference(
        query.float(), None, None, key_cache, value_cache, tables, cu, context, scale, window, None,
        scales.k_scale, scales.v_scale,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), ref, **KERNEL_16_BIT[torch.bfloat16])
    prefill_attention(query, key, value, key_cache, value_cache, plan, scale, window, 30.0, scales)
    prefill_attention(query.float(), key.float(), value.float(), key_cache, value_cache, plan, scale, window)
    assert len(calls) == 1
