"""paged_decode_attention_cpu (Numba) against the torch reference and a dense oracle.

16-bit caches are checked against the reference computed in float32 on the same 16-bit
values: the kernel also computes in float32 and rounds only its output, so the two differ
by at most half a unit in the last place of the output dtype (relative ``2**-8`` for
bfloat16, ``2**-11`` for float16) beyond float32's own rounding differences.
"""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_factories import huge_cache, make_paged_kv, naive_attention

import pagedllm.kernels.paged_decode_attention_cpu as cpu_kernel
from pagedllm.kernels import paged_decode_attention_reference
from pagedllm.kernels.kv_quant import quantize
from pagedllm.kernels.paged_decode_attention_cpu import (
    ITEMS_PER_THREAD,
    DecodeRows,
    choose_kv_splits,
    decode_rows_attention,
    paged_decode_attention_cpu,
)

# NOTE: float32's own tolerance (two summation orders), widened by half an output ulp for 16-bit outputs.
HALF_ULP = {torch.float32: 0.0, torch.bfloat16: 2**-8, torch.float16: 2**-11}
DTYPES = list(HALF_ULP)


def _case(lens, num_heads, num_kv_heads, head_dim, block_size, window=None, dtype=torch.float32, **kwargs):
    """With a ``window`` the blocks before each query's window are garbage in the table (freed)."""
    visible_from = None if window is None else [max(0, n - window) for n in lens]
    kv = make_paged_kv(
        lens, num_kv_heads, head_dim, block_size, dtype, device="cpu", visible_from=visible_from, **kwargs
    )
    query = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    return query, kv


def _float32_reference(query, kv, scale, window=None, softcap=None):
    """The reference in float32 on the same (possibly 16-bit) values."""
    wide = dataclasses.replace(kv, key_cache=kv.key_cache.float(), value_cache=kv.value_cache.float())
    return _run(paged_decode_attention_reference, query.float(), wide, scale, window, softcap)


def _assert_matches(out, expected, dtype):
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=2e-5, rtol=1e-4 + HALF_ULP[dtype])


def _run(fn, query, kv, scale, window=None, softcap=None):
    return fn(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, scale, window, softcap)


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=9),
    block_size=st.sampled_from([1, 3, 8, 16, 32]),
    heads=st.sampled_from([(1, 1), (4, 4), (4, 2), (6, 2), (8, 1), (16, 2), (8, 8)]),
    head_dim=st.sampled_from([8, 64, 80]),
    threads=st.sampled_from([1, 2]),
    window=st.one_of(st.none(), st.just(1), st.integers(1, 100)),
    softcap=st.sampled_from([None, 0.5, 5.0, 50.0]),
)
def test_matches_reference(lens, block_size, heads, head_dim, threads, window, softcap):
    """Any lengths (around block boundaries too), GQA/MQA, NaN in unused slots and junk
    table entries past each sequence (and before its window), with the KV heads split
    over items or not, with or without a sliding window and soft-capping."""
    query, kv = _case(lens, *heads, head_dim, block_size, window)
    scale = head_dim**-0.5
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = _run(paged_decode_attention_cpu, query, kv, scale, window, softcap)
    finally:
        torch.set_num_threads(previous)
    assert not out.isnan().any()
    expected = _run(paged_decode_attention_reference, query, kv, scale, window, softcap)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=9),
    block_size=st.sampled_from([1, 3, 8, 16, 32]),
    heads=st.sampled_from([(1, 1), (4, 2), (6, 2), (8, 1), (8, 8)]),
    head_dim=st.sampled_from([8, 64, 80]),
    threads=st.sampled_from([1, 2]),
    window=st.one_of(st.none(), st.just(1), st.integers(1, 100)),
    softcap=st.sampled_from([None, 0.5, 50.0]),
)
def test_16_bit_caches_match_the_float32_reference(dtype, lens, block_size, heads, head_dim, threads, window, softcap):
    """bfloat16 and float16 caches and queries, read as 16-bit patterns and widened in the
    kernel: within half an output ulp of float32 attention on the same values, with the
    same NaN slots, junk table entries, splits, windows and caps as float32."""
    query, kv = _case(lens, *heads, head_dim, block_size, window, dtype=dtype)
    scale = head_dim**-0.5
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = _run(paged_decode_attention_cpu, query, kv, scale, window, softcap)
    finally:
        torch.set_num_threads(previous)
    assert not out.isnan().any()
    _assert_matches(out, _float32_reference(query, kv, scale, window, softcap), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap", [(None, None), (100, None), (16, 20.0), (1, None), (333, 1.0)])
def test_matches_dense_attention_on_long_contexts(window, softcap, dtype):
    query, kv = _case([700, 1, 333], 8, 2, 64, 16, window, dtype=dtype)
    out = _run(paged_decode_attention_cpu, query, kv, 0.125, window, softcap)
    dense = torch.cat(
        [naive_attention(query[s : s + 1], kv.keys[s], kv.values[s], 0.125, window, softcap) for s in range(3)]
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), dense, atol=1e-5, rtol=1e-4 + HALF_ULP[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_finite_16_bit_value_is_widened_exactly(dtype):
    """One cached position: the output is its value row times a probability of exactly 1, so
    every finite 16-bit pattern (subnormals included) must come back unchanged."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    values = values[values.isfinite()]
    head_dim = values.numel()
    cache = torch.zeros(1, 1, 1, head_dim, dtype=dtype)
    value_cache = values.view(1, 1, 1, head_dim).clone()
    one = torch.ones(1, dtype=torch.int32)
    out = paged_decode_attention_cpu(cache[0], cache, value_cache, one[None] * 0, one, 1.0)
    assert out.dtype == dtype
    assert torch.equal(out.view(-1).float(), values.float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_context_gives_zeros_and_empty_batch_gives_empty(dtype):
    query, kv = _case([0, 5], 4, 2, 16, 4, dtype=dtype)
    out = _run(paged_decode_attention_cpu, query, kv, 0.25)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    _assert_matches(out, _float32_reference(query, kv, 0.25), dtype)
    none = paged_decode_attention_cpu(
        query[:0], kv.key_cache, kv.value_cache, kv.block_tables[:0], kv.context_lens[:0], 1
    )
    assert none.shape == (0, 4, 16)
    assert none.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_offsets_past_int32(dtype):
    """Block ids whose element offset overflows int32 are addressed correctly."""
    shape = (2**31 // (4 * 2 * 8) + 8, 4, 2, 8)  # block_size 4, 2 KV heads, head_dim 8
    caches = (huge_cache(shape, dtype, "cpu"), huge_cache(shape, dtype, "cpu"))
    far = torch.tensor([shape[0] - 1, shape[0] - 3, 5], dtype=torch.int64)
    query, kv = _case([6, 3], 4, 2, 8, 4, caches=caches, block_ids=far, dtype=dtype)
    _assert_matches(_run(paged_decode_attention_cpu, query, kv, 0.3), _float32_reference(query, kv, 0.3), dtype)


def test_non_contiguous_query_and_table_views():
    query, kv = _case([9, 30, 17], 8, 4, 32, 8)
    wide = torch.randn(3, 8, 64)[:, :, :32]  # a strided query view
    wide.copy_(query)
    tables = torch.cat([kv.block_tables, kv.block_tables], dim=1)[:, : kv.block_tables.shape[1]]
    out = paged_decode_attention_cpu(wide, kv.key_cache, kv.value_cache, tables, kv.context_lens, 0.2)
    torch.testing.assert_close(out, _run(paged_decode_attention_reference, query, kv, 0.2))


@pytest.mark.parametrize(
    ("num_seqs", "kv_heads", "threads", "splits"),
    [(64, 8, 2, 1), (8, 8, 2, 1), (2, 8, 2, 4), (1, 8, 2, 8), (1, 6, 2, 6), (3, 6, 2, 3), (1, 1, 8, 1), (0, 4, 2, 4)],
)
def test_kv_splits_give_every_thread_work(num_seqs, kv_heads, threads, splits):
    got = choose_kv_splits(num_seqs, kv_heads, threads)
    assert got == splits
    assert kv_heads % got == 0
    assert num_seqs * got >= min(ITEMS_PER_THREAD * threads, num_seqs * kv_heads)


def test_refuses_what_it_cannot_run():
    query, kv = _case([4], 4, 2, 8, 4)
    with pytest.raises(TypeError, match="differs from the cache dtype"):
        paged_decode_attention_cpu(
            query.bfloat16(), kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 1.0
        )
    with pytest.raises(TypeError, match="caches must share one dtype"):
        paged_decode_attention_cpu(
            query, kv.key_cache.double(), kv.value_cache.double(), kv.block_tables, kv.context_lens, 1.0
        )
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_decode_attention_cpu(query, kv.key_cache, kv.value_cache, kv.block_tables.long(), kv.context_lens, 1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention_cpu(query[:, :3], kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 1.0)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        _run(paged_decode_attention_cpu, query, kv, 1.0, window=-3)
    with pytest.raises(ValueError, match="logit_softcap must be > 0"):
        _run(paged_decode_attention_cpu, query, kv, 1.0, softcap=-1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_step_s_rows_serve_every_layer(dtype):
    """A step's tables and lengths, checked and converted once (``DecodeRows``), read by each layer's call
    over its own caches: what the one-call entry gives, exactly, and rows of another step are refused."""
    query, kv = _case([9, 30, 17], 8, 4, 32, 8, dtype=dtype)
    rows = DecodeRows(kv.block_tables, kv.context_lens)
    for layer in range(3):
        keys, values = (torch.randn_like(c, dtype=torch.float32).to(dtype) for c in (kv.key_cache, kv.value_cache))
        layer_kv = dataclasses.replace(kv, key_cache=keys, value_cache=values)
        q = torch.randn_like(query, dtype=torch.float32).to(dtype)
        out = decode_rows_attention(q, keys, values, rows, 0.2, None, 5.0 if layer else None)
        assert torch.equal(out, _run(paged_decode_attention_cpu, q, layer_kv, 0.2, None, 5.0 if layer else None))
        _assert_matches(out, _float32_reference(q, layer_kv, 0.2, None, 5.0 if layer else None), dtype)
    with pytest.raises(ValueError, match=r"a row per sequence of the query \(2\), got 3"):
        decode_rows_attention(query[:2], kv.key_cache, kv.value_cache, rows, 0.2)
    with pytest.raises(ValueError, match="context_lens must be torch.int32 \\[3\\]"):
        DecodeRows(kv.block_tables, kv.context_lens[:2])


@pytest.mark.parametrize("quantized", [False, True])
def test_serial_and_parallel_builds_agree_exactly(monkeypatch, quantized):
    """Small calls run on the calling thread, large ones on Numba's pool, each item dealt to a
    thread by its length: the same items computed the same way, so the same bits."""
    query, kv = _case([3, 70, 17, 45, 1, 33], 8, 2, 64, 16, dtype=torch.bfloat16)
    if quantized:  # NOTE: int8 rows with their scales (kernels/kv_quant.py)
        kv = dataclasses.replace(
            kv, key_cache=quantize(kv.key_cache, torch.int8), value_cache=quantize(kv.value_cache, torch.int8)
        )
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = []
        for least in (1 << 40, 0):  # NOTE: serial, then parallel
            monkeypatch.setattr(cpu_kernel, "PARALLEL_MIN_WORK", least)
            outs.append(_run(paged_decode_attention_cpu, query, kv, 0.125, None, 20.0))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(outs[0], outs[1])
    if not quantized:
        _assert_matches(outs[0], _float32_reference(query, kv, 0.125, None, 20.0), torch.bfloat16)


def test_compiles_without_a_writable_cache_directory(monkeypatch):
    """Where numba finds no writable cache directory (read-only image, no home), the
    kernel is compiled without the on-disk cache instead of failing."""
    asked = []

    def jit(kernel, cache, parallel=True):
        asked.append(cache)
        if cache:
            raise RuntimeError("cannot cache function 'kernel': no locator available for file 'kernel.py'")
        return kernel  # the kernel's Python source, run as it is: same numbers, slowly

    monkeypatch.setattr(cpu_kernel, "_jit", jit)
    cpu_kernel._compiled_kernel.cache_clear()
    try:
        query, kv = _case([5, 2], 4, 2, 8, 4)
        out = _run(paged_decode_attention_cpu, query, kv, 0.5)
    finally:
        cpu_kernel._compiled_kernel.cache_clear()
    assert asked == [True, False]
    torch.testing.assert_close(out, _run(paged_decode_attention_reference, query, kv, 0.5), atol=2e-5, rtol=1e-4)


def test_first_call_keeps_torchs_thread_count_and_uses_it():
    """Starting Numba's pool (on the first call, in a fresh process) must not raise torch's
    thread count to every CPU of the host: they share one OpenMP runtime."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPUs to tell 1 thread from all of them")
    script = """
import torch
torch.set_num_threads(1)
from pagedllm.kernels.paged_decode_attention_cpu import numba, paged_decode_attention_cpu
q, k = torch.randn(3, 4, 8), torch.randn(6, 4, 2, 8)
tables, lens = torch.arange(6, dtype=torch.int32).view(3, 2), torch.tensor([5, 8, 1], dtype=torch.int32)
for _ in range(2):
    paged_decode_attention_cpu(q, k, k, tables, lens, 0.3)
    print(torch.get_num_threads(), numba.get_num_threads())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "1", "1", "1"], out


def test_numba_follows_each_threads_own_count_when_it_changes():
    """``_use_threads`` asks Numba only when the count changes, per calling thread: Numba's count is
    per thread, so a new thread (Numba's default there) still gets the count it asks for."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPUs to tell 1 thread from 2")
    script = """
import threading
from pagedllm.kernels._cpu_items import _use_threads, numba
seen = []
for n in (1, 1, 2, 1):
    seen.append((_use_threads(n), numba.get_num_threads()))
def other():
    seen.append((_use_threads(1), numba.get_num_threads()))
t = threading.Thread(target=other)
t.start(); t.join()
print(seen)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[(1, 1), (1, 1), (2, 2), (1, 1), (1, 1)]", out
