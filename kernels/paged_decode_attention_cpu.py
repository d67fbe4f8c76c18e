"""Paged decode attention compiled for the CPU (Numba): each cached K/V row is read once.

The torch path has to gather a sequence's blocks into one contiguous tensor before SDPA
can run: it reads every K/V byte, writes it again and reads the copy. This kernel walks
the block table instead and reads each block where it lies. One work item is one
sequence and a run of its KV heads; the items are dealt to the threads longest first, each
to the thread with the least work so far (kernels/_cpu_items.py)::

    item (seq s, kv heads h0..h1)
      pass 1: for each block of s, each slot, each KV head: widen its key row once,
              then score = q . k for each query head of the KV head's group (reads K once)
      soft-cap (if asked) and softmax over the scores of each query head
      pass 2: for each block of s, each slot, each KV head: widen its value row once,
              then out += p * v for each query head of the group              (reads V once)

A block's slots hold every KV head contiguously (``[block_size, num_kv_heads, head_dim]``),
so an item that takes all the KV heads of its sequence streams whole blocks. With few
sequences the heads are split over more items so every thread has work. With a sliding
window the passes walk only the visible positions ``[context_len - window, context_len)``.

Each pass walks the visible blocks in order and indexes each block's own view
(``key_cache[block]``): unit-stride rows, each pass streaming ~23 GB/s of a plain read's 28
(2-core AVX-512 CPU, float32, 8 layers of 8 heads of 64, 16-token blocks; batch 64 at context
226: 22 ms a step against 29 for gathering indices per position). Blocks lie anywhere, so each
starts a stream the CPU's prefetcher finds page by page: while a pass reads block b it
prefetches the first line of each page of block b + 1 (``python -m benchmarks.cpu_attention
--threads 2 --batch 16 64 --layers 8``: 5-10% off a call in float32, 9-12% in bfloat16).

With a bfloat16 query over a bfloat16 or 8-bit cache (head sizes a multiple of 32, blocks of
16 slots or a multiple) on AVX-512-BF16 CPUs, a work item runs in one C call
(kernels/decode_scores_cpu.py): pass 1 scores sixteen positions per instruction, softmax and
pass 2 run in float32 vectors; with a soft-cap only a bfloat16 cache's pass 1 does.

Caches may be float32, bfloat16, float16 or 8-bit (fp8 e4m3 / e5m2, int8 rows with their
scale: kernels/kv_quant.py); scores, softmax and the weighted sum are float32 whatever the
cache holds, and the output is rounded to the query's dtype once at the end. Each element
is widened exactly as it is read (kernels/_cpu_widen.py); an int8 row's scale multiplies
its dot product and its weight, an fp8 cache's per-tensor scales the score scale and the
output, so an 8-bit cache streams half the bytes of a 16-bit one for the same work.

:func:`paged_decode_attention_reference` (same signature) is the oracle. The engine checks and
converts a step's tables and lengths once (:class:`DecodeRows`) for every layer's call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from . import _cpu_items, _cpu_widen, decode_scores_cpu
from ._cpu_items import ITEMS_PER_THREAD, PRANGE_ONLY, _use_threads, choose_kv_splits, thread_items
from ._cpu_items import prefetch_block as _prefetch_block
from ._cpu_widen import E4M3_FACTOR
from ._paged import check_block_tables, check_int_vector, check_kv_caches, check_query, check_window
from .paged_decode_attention import paged_decode_attention_reference

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; this keeps the package importable
    numba = None  # type: ignore[assignment]

HAS_NUMBA = numba is not None
_prange = numba.prange if HAS_NUMBA else range
if HAS_NUMBA:
    from ._numba_cpu import load, renamed_copy, store_like

__all__ = [
    "CACHE_DTYPES",
    "HAS_NUMBA",
    "ITEMS_PER_THREAD",
    "choose_kv_splits",
    "paged_decode_attention_cpu",
    "paged_decode_attention_reference",
]

# NOTE: the integer type of each 16-bit format is what tells the kernel how to widen it
# (see _cpu_widen.widen): the two must never share one. fp8 formats share uint8 and get
# their own widening by specialisation; an int8 row ends with its float16 scale.
_KERNEL_VIEWS = {torch.float32: torch.float32, torch.bfloat16: torch.uint16, torch.float16: torch.int16}
CACHE_DTYPES = tuple(_KERNEL_VIEWS)
"""The model dtypes the compiled kernel reads (as query and cache; any of them over an 8-bit cache)."""
# NOTE: below this much work (table positions x query heads x head size) a call runs on
# the calling thread. A parallel call waits for its slowest thread: where other processes hold
# the cores, that is a scheduler time slice (milliseconds) per call, 24 times a step for a
# 24-layer model. On a quiet 2-core machine two threads pay from small sizes on: batch 1 at a
# context of 194 (14 heads of 64, 174K) takes 33 us per call on two threads, 40 us on one
# (``python -m benchmarks.cpu_attention``), so only the smallest calls stay on one.
PARALLEL_MIN_WORK = 1 << 16
_ITEM_DTYPES = {"widen": torch.bfloat16, "widen_e4m3": torch.float8_e4m3fn, "widen_e5m2": torch.float8_e5m2}
_FORMATS = {  # 8-bit cache dtype -> (view, widening, factor of the widened value)
    torch.float8_e4m3fn: (torch.uint8, "widen_e4m3", E4M3_FACTOR),
    torch.float8_e5m2: (torch.uint8, "widen_e5m2", 1.0),
    torch.int8: (torch.int8, "widen", 1.0),
}


def _device_function(fn):
    """A helper the kernel calls: compiled into it by Numba (inlined), plain Python without numba."""
    return numba.njit(inline="always", fastmath=True, boundscheck=False)(fn) if HAS_NUMBA else fn


_widen = _cpu_widen.widen
ROW_SCALED = False
"""Whether cache rows end with their float16 scale (int8): a constant in each specialised copy."""


@_device_function
def _row_scale(block, slot, kv, head_dim):
    """The float16 scale that ends an int8 row (``block[slot, kv]``), as float32."""
    if not ROW_SCALED:
        return np.float32(1.0)
    bits = (np.int32(block[slot, kv, head_dim + 1]) << 8) | (np.int32(block[slot, kv, head_dim]) & 0xFF)
    return _cpu_widen.widen(np.int16(bits))


@_device_function
def _scores(query, key_cache, block_table, start, end, kv0, group, scale):
    """Pass 1, ``[heads, end - start]``: each query head (``query`` is ``[heads, head_dim]``)
    against the cached keys of positions ``start .. end - 1``; head i reads KV head ``kv0 + i // group``.

    NOTE: a key row is widened once, into ``row``, for all ``group`` query heads that share it.
    """
    heads = query.shape[0]
    head_dim = HEAD_DIM or query.shape[1]
    block_size = key_cache.shape[1]
    scores = np.empty((heads, max(end - start, 0)), np.float32)
    row = np.empty(head_dim, np.float32)
    first, last = _cpu_items.visible_blocks(start, end, block_size)
    for b in range(first, last):
        if b + 1 < last:
            _prefetch_block(key_cache, block_table[b + 1])
        block = key_cache[block_table[b]]  # [block_size, num_kv_heads, head_dim]
        base = b * block_size
        for slot in range(max(start - base, 0), min(end - base, block_size)):
            col = base + slot - start
            if group == 1 or not WIDEN_ONCE:  # NOTE: read each element where it lies (float32, or no group)
                for i in range(heads):
                    kv = kv0 + i // group
                    acc = np.float32(0.0)
                    for d in range(head_dim):
                        acc += query[i, d] * _widen(block[slot, kv, d])
                    scores[i, col] = acc * scale * _row_scale(block, slot, kv, head_dim)
                continue
            for g in range(heads // group):
                for d in range(head_dim):
                    row[d] = _widen(block[slot, kv0 + g, d])
                row_scale = scale * _row_scale(block, slot, kv0 + g, head_dim)
                for i in range(g * group, g * group + group):
                    acc = np.float32(0.0)
                    for d in range(head_dim):
                        acc += query[i, d] * row[d]
                    scores[i, col] = acc * row_scale
    return scores


@_device_function
def _attend(query, key_cache, value_cache, block_table, start, end, kv0, group, scale, softcap, out_scale, out):
    """One item: ``out`` = out_scale x attention over ``start .. end - 1``, head i on KV head ``kv0 + i // group``;
    ``query`` and ``out`` ``[heads, head_dim]`` float32, or bfloat16 bits (uint16: widened once here, rounded
    once as written)."""
    heads, head_dim = query.shape[0], HEAD_DIM or query.shape[1]
    q = np.empty((heads, head_dim), np.float32)
    for i in range(heads):
        for d in range(head_dim):
            q[i, d] = load(query[i, d])
    probs = _scores(q, key_cache, block_table, start, end, kv0, group, scale)
    if softcap > 0:
        _cpu_items.soft_cap(probs, softcap)
    _cpu_items.softmax_rows(probs)
    _weighted_values(probs, value_cache, block_table, start, end, kv0, group, out_scale, out)


@_device_function
def _weighted_values(probs, value_cache, block_table, start, end, kv0, group, out_scale, out):
    """Pass 2: ``out[i] = sum_p probs[i, p - start] * v[p]`` over positions ``start .. end - 1``
    (``out`` is ``[heads, head_dim]``); a value row is widened once for its ``group`` query heads."""
    heads = out.shape[0]
    head_dim = HEAD_DIM or out.shape[1]
    block_size = value_cache.shape[1]
    acc = np.zeros((heads, head_dim), np.float32)
    row = np.empty(head_dim, np.float32)
    first, last = _cpu_items.visible_blocks(start, end, block_size)
    for b in range(first, last):
        if b + 1 < last:
            _prefetch_block(value_cache, block_table[b + 1])
        block = value_cache[block_table[b]]  # [block_size, num_kv_heads, head_dim]
        base = b * block_size
        for slot in range(max(start - base, 0), min(end - base, block_size)):
            col = base + slot - start
            if group == 1 or not WIDEN_ONCE:
                for i in range(heads):
                    kv = kv0 + i // group
                    w = probs[i, col] * _row_scale(block, slot, kv, head_dim)
                    for d in range(head_dim):
                        acc[i, d] += w * _widen(block[slot, kv, d])
                continue
            for g in range(heads // group):
                for d in range(head_dim):
                    row[d] = _widen(block[slot, kv0 + g, d])
                row_scale = _row_scale(block, slot, kv0 + g, head_dim)
                for i in range(g * group, g * group + group):
                    w = probs[i, col] * row_scale
                    for d in range(head_dim):
                        acc[i, d] += w * row[d]
    for i in range(heads):
        for d in range(head_dim):
            out[i, d] = store_like(acc[i, d] * out_scale, out)


def paged_decode_attention_cpu_kernel(
    query,  # [num_seqs, num_heads, head_dim] float32
    key_cache,  # [num_blocks, block_size, num_kv_heads, head_dim] float32, or 16-bit patterns (see _widen)
    value_cache,  # [num_blocks, block_size, num_kv_heads, head_dim] like key_cache
    block_tables,  # [num_seqs, max_blocks] int32
    context_lens,  # [num_seqs] int32
    scale,
    window,  # sliding window in positions; 0: none
    softcap,  # logit soft-cap; 0: none
    out_scale,  # the output's factor (an fp8 cache's v_scale)
    kv_splits,  # items per sequence; divides num_kv_heads
    threads,  # Numba's thread count: one prange iteration each
    out,  # [num_seqs, num_heads, head_dim] float32, written
):
    """The kernel's source (one work item = one sequence and a run of its heads); :func:`_compiled_kernel` runs."""
    num_seqs, num_heads, _ = query.shape
    group = num_heads // key_cache.shape[2]
    heads = num_heads // kv_splits  # query heads per item, a multiple of group
    plan = thread_items(context_lens, window, kv_splits, threads)
    for t in _prange(threads):
        for n in range(plan[t, 0]):
            item = plan[t, n + 1]
            seq = item // kv_splits
            h0 = (item - seq * kv_splits) * heads
            end = context_lens[seq]
            start = max(end - window, 0) if window > 0 else 0
            q, o = query[seq, h0 : h0 + heads], out[seq, h0 : h0 + heads]
            table = block_tables[seq]
            _attend(q, key_cache, value_cache, table, start, end, h0 // group, group, scale, softcap, out_scale, o)


@functools.cache
def _compiled_kernel(head_dim: int, widening="widen", row_scaled=False, parallel=True, widen_once=True, c_path=0):
    """The kernel for heads of ``head_dim`` (on Numba's pool, or on the calling thread where
    not ``parallel``), compiled by Numba on first use, its machine code
    cached on disk when a cache directory is writable (else compiled once per process, a
    few seconds).

    NOTE: compiled lazily so that importing the kernels never needs numba's cache
    directory: a read-only image and an unwritable home still import and serve.
    """
    # NOTE: the C pass's library is loaded before the kernel that calls it is compiled or read from disk
    c_path = c_path if decode_scores_cpu.available() else 0
    kernel = _specialised(head_dim, widening, row_scaled, parallel, widen_once, c_path)
    try:
        return _jit(kernel, cache=True, parallel=parallel)
    except RuntimeError:  # numba: "cannot cache function ... no locator available"
        return _jit(kernel, cache=False, parallel=parallel)


HEAD_DIM = 0
"""The head size the passes' loops run over: 0 here (read from the arrays), a constant in each copy."""
WIDEN_ONCE = True
"""Whether a cache row is widened once into a float32 row for its group's query heads (a
constant in each copy): off for a float32 cache (each query head reads the row where it lies,
from L1) and for groups of one."""


def _specialised(
    head_dim: int, widening="widen", row_scaled=False, parallel=True, widen_once=True, c_path=0
) -> Callable:
    """A copy of the kernel whose passes see ``HEAD_DIM = head_dim`` as a compile-time constant.

    NOTE: Numba freezes a function's globals into its code. With the head size a constant,
    the dot product and the weighted sum over one head's elements compile to a fixed number
    of vector instructions, without a loop, a remainder or the registers they take (float32
    and bfloat16, 8 heads of 64, 16 and 64 sequences: 7-15% less time per call, ``python -m
    benchmarks.cpu_attention``). Each copy has its own name, which is what Numba's disk cache
    knows it by. An 8-bit cache's copy also gets its ``widening`` (a name in _cpu_widen) and
    whether rows carry a scale (``ROW_SCALED``) the same way. The serial build's name says so:
    the disk cache does not tell builds apart by their compile options.
    """
    names = dict(HEAD_DIM=head_dim, ROW_SCALED=row_scaled, WIDEN_ONCE=widen_once, _widen=getattr(_cpu_widen, widening))
    tag = f"_d{head_dim}" + ("_int8" if row_scaled else "" if widening == "widen" else f"_{widening[6:]}")
    tag += ("" if parallel else "_serial") + ("" if widen_once else "_direct") + ("", "_cscores", "_citem")[c_path]
    for fn in (_row_scale.py_func, _scores.py_func, _weighted_values.py_func):
        names[fn.__name__] = _device_function(renamed_copy(fn, f"{fn.__name__}{tag}", names))
    if c_path:  # NOTE: pass 1 (1) or the whole item (2) in C (kernels/decode_scores_cpu.c), same signatures
        names["_scores"] = decode_scores_cpu.scores
    attend = _device_function(renamed_copy(_attend.py_func, f"_attend{tag}", names))
    c_item = c_path == 2 and decode_scores_cpu.attend_for(torch.int8 if row_scaled else _ITEM_DTYPES[widening])
    names["_attend"] = c_item or attend
    return renamed_copy(paged_decode_attention_cpu_kernel, f"paged_decode_attention_cpu_kernel{tag}", names)


def _jit(kernel: Callable, cache: bool, parallel: bool = True):
    options = PRANGE_ONLY if parallel else False
    jit = numba.njit(cache=cache, parallel=options, fastmath=True, nogil=True, boundscheck=False)  # type: ignore[arg-type]
    return jit(kernel)


def paged_decode_attention_cpu(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim] float32, bfloat16 or float16
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] query's dtype or 8-bit
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] like key_cache
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Decode attention on CPU tensors of one dtype of :data:`CACHE_DTYPES` (the caches may
    be 8-bit instead, ``k_scale``/``v_scale`` an fp8 cache's scales), on as many threads as
    torch uses; computed in float32, returned in the query's dtype.

    NOTE: like the Triton kernel, table entries for a sequence's visible blocks must be
    valid block ids: they are not bounds-checked. Entries past them, and with a
    ``sliding_window`` those before the window's first block, are never read. An empty
    context gives zeros.
    """
    rows = DecodeRows(block_tables, context_lens)
    return decode_rows_attention(
        query, key_cache, value_cache, rows, scale, sliding_window, logit_softcap, k_scale, v_scale
    )


class DecodeRows:
    """A step's decode rows as the kernel reads them, checked and converted once for all its layers: block
    tables [num_seqs, max_blocks] int32 and context lengths [num_seqs] int32 on the CPU. NOTE: at batch 1
    (Qwen2.5-0.5B shape, 2 threads) the work around a call (checks, arrays, the query's widening and the
    output's rounding in torch) had taken ~50 us of ~70."""

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
        if not HAS_NUMBA:
            raise RuntimeError("the compiled CPU decode kernel needs numba: pip install numba")
        check_block_tables(block_tables, block_tables.shape[0] if block_tables.dim() == 2 else -1)
        check_int_vector(context_lens, "context_lens", block_tables.shape[0])
        if not (block_tables.is_cpu and context_lens.is_cpu):
            raise ValueError(f"block_tables and context_lens must be on the CPU, got {block_tables.device}")
        self.num_seqs, self.max_blocks = block_tables.shape
        self.tables, self.lens = block_tables.contiguous().numpy(), context_lens.contiguous().numpy()


def decode_rows_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    rows: DecodeRows,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """:func:`paged_decode_attention_cpu` (same tensors) for the rows of a :class:`DecodeRows`: a layer of a step."""
    check_kv_caches(key_cache, value_cache)
    check_query(query, key_cache)
    check_window(sliding_window, logit_softcap)
    if query.shape[0] != rows.num_seqs:
        raise ValueError(
            f"block_tables must have a row per sequence of the query ({query.shape[0]}), got {rows.num_seqs}"
        )
    if not (query.is_cpu and key_cache.is_cpu and value_cache.is_cpu):
        raise ValueError(f"query and caches must be on the CPU, got {query.device} and {key_cache.device}")
    # NOTE: a bfloat16 query and output reach the kernel as their bits (widened and rounded there); others
    # in float32, the output rounded to the query's dtype after
    bits = query.dtype == torch.bfloat16
    out = torch.empty(query.shape, dtype=query.dtype if bits else torch.float32)
    if query.shape[0] == 0:
        return out.to(query.dtype)
    cache_view, widening, factor = _FORMATS.get(key_cache.dtype) or (_KERNEL_VIEWS[key_cache.dtype], "widen", 1.0)
    threads = _use_threads(torch.get_num_threads())
    # NOTE: the tables' width bounds every context: no pass over the lengths needed
    most = rows.num_seqs * rows.max_blocks * key_cache.shape[1] * query.shape[1] * query.shape[2]
    parallel = threads > 1 and most >= PARALLEL_MIN_WORK
    threads = threads if parallel else 1
    splits = choose_kv_splits(rows.num_seqs, key_cache.shape[2], threads)
    fp8, widen_once = widening != "widen", cache_view != torch.float32
    c_path = decode_scores_cpu.c_path(query, key_cache, value_cache, logit_softcap)
    q = query.contiguous().view(torch.uint16) if bits else query.float().contiguous()
    _compiled_kernel(query.shape[2], widening, key_cache.dtype == torch.int8, parallel, widen_once, c_path)(
        q.numpy(),
        key_cache.view(cache_view).numpy(),
        value_cache.view(cache_view).numpy(),
        rows.tables,
        rows.lens,
        np.float32(scale * (k_scale * factor if fp8 else 1.0)),
        sliding_window or 0,
        np.float32(logit_softcap or 0.0),
        np.float32(v_scale * factor if fp8 else 1.0),
        splits,
        threads,
        (out.view(torch.uint16) if bits else out).numpy(),
    )
    return out if bits else out.to(query.dtype)
