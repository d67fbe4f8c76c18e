"""CPU decode attention over a bfloat16 cache in C (kernels/decode_scores_cpu.c): the scores
pass, and a whole work item (scores, softmax, weighted values).

The compiled decode kernel (kernels/paged_decode_attention_cpu.py) scores each cached key
against the query heads of its KV head: in Numba a dot product of ``head_dim`` per query head
per position, each ending in a horizontal sum. The C pass transposes sixteen key rows in
registers and scores sixteen positions per VDPBF16PS instead (about 3.5 ns a position for
seven heads of 64 when the block is cached), and prefetches the rows two chunks ahead. On a
Qwen2.5-0.5B-shaped call (14 query heads over 2 KV heads of 64, batch 16, contexts of
100-250, 24 layers' caches of 4,096 blocks each, 2 threads) the kernel took 15% less time
with it in four in-process A/B pairs (0.225-0.283 against 0.265-0.378 ms a call; the VM's
speed drifted between pairs).

Softmax and the Numba weighted sum then took about two thirds of such a call. The C item
(:func:`attend`) runs them too: softmax in float32 vectors (the exp of kernels/_fast_exp.py),
the weighted sum with float32 accumulators in registers over value rows widened exactly, the
probabilities never rounded, the output rounded to bfloat16 once. Without a soft-cap the
kernel runs each work item in one call to it (:func:`c_path`); with one, only :func:`scores`.

8-bit caches (kernels/kv_quant.py) take the C item too, under a bfloat16 query, each format in
its own compiled copy (:func:`attend_for`): K is widened exactly to bfloat16 pairs and scored
the same way, an int8 row's float16 scale multiplies its position's scores and its V row, and
an fp8 cache's per-tensor scales are the caller's (the score scale and ``out_scale``). At the
Qwen2.5-0.5B shape (batch 16, 24 layers' caches of 4,096 blocks of 16, 2 threads, in-process,
three alternating runs each) a call took, in ms, at contexts ~200: bfloat16 0.16-0.17, int8
0.09-0.10 (Numba 0.19), e4m3 0.12-0.14 (Numba 0.22); at ~1000: bfloat16 0.75, int8 0.46-0.58
(Numba 1.01-1.04), e4m3 0.62-0.63 (Numba 1.09-1.10).

:func:`scores` and :func:`attend` are Numba device functions with the signatures of the
kernel's ``_scores`` and ``_attend``, which its specialised copies take in their place; the C
source is built like the bf16 GEMM's (kernels/_cpu_compile.py).

NOTE: Numba's disk cache keys the decode kernel on its own file: an edit here must also touch
``paged_decode_attention_cpu.py``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import FunctionType

import numpy as np
import torch

try:
    import numba
    from numba import types
except ImportError:  # pragma: no cover - numba is a dependency; this keeps the package importable
    numba = None  # type: ignore[assignment]

from ._cpu_compile import AVX512_BF16_CFLAGS, build_library, cpu_has_avx512_bf16
from .kv_quant import C_FORMAT_NAMES

__all__ = ["MAX_GROUP", "applies", "attend_for", "available", "c_path", "scores"]

SOURCE = Path(__file__).with_suffix(".c")
SYMBOL = "pagedllm_decode_scores_bf16"
ITEM_SYMBOLS = {dtype: f"pagedllm_decode_attention_{name}" for dtype, name in C_FORMAT_NAMES.items()}
"""The C item of each cache dtype it reads (under a bfloat16 query)."""
MAX_GROUP = 16
"""Query heads per KV head the C pass takes (its stack holds their query pairs)."""
MAX_HEAD_DIM = 256


@functools.cache
def available() -> bool:
    """Whether the C pass runs here (AVX-512-BF16, Numba, a C compiler); loads the bfloat16 cache's
    library (its work item and the scores pass) for Numba."""
    return cpu_has_avx512_bf16() and format_available(torch.bfloat16)


@functools.cache
def format_available(cache_dtype: torch.dtype) -> bool:
    """Whether the C work item over ``cache_dtype`` (a key of :data:`ITEM_SYMBOLS`) is built and
    loaded for Numba. Each format is a library of its own (``-DITEM_<FORMAT>``), built the first
    time a cache of it is read: compiling one takes seconds, all four several times that."""
    flag = "-DITEM_" + C_FORMAT_NAMES[cache_dtype].upper()
    return cpu_has_avx512_bf16() and build_library(SOURCE, (*AVX512_BF16_CFLAGS, flag)) is not None


def applies(head_dim: int, block_size: int, group: int) -> bool:
    """Whether a bfloat16 cache of these sizes can take the C pass (and it is available)."""
    shaped = head_dim % 32 == 0 and head_dim <= MAX_HEAD_DIM and block_size % 16 == 0 and 1 <= group <= MAX_GROUP
    return shaped and available()


def c_path(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, softcap: float | None) -> int:
    """What of the decode kernel runs in C for these tensors: 0 nothing, 1 pass 1 (the scores),
    2 the whole work item (a bfloat16 query over a bfloat16 or 8-bit cache of fitting sizes
    whose slots hold each head's row contiguously, no soft-cap; with one, a bfloat16 cache's
    scores only)."""
    head_dim, group = query.shape[2], query.shape[1] // key_cache.shape[2]
    rows = key_cache.stride()[2:] == value_cache.stride()[2:] == (key_cache.shape[3], 1)
    read = query.dtype == torch.bfloat16 and key_cache.dtype in ITEM_SYMBOLS
    if not (read and rows and applies(head_dim, key_cache.shape[1], group) and format_available(key_cache.dtype)):
        return 0
    if softcap:
        return 1 if key_cache.dtype == torch.bfloat16 else 0
    return 2


if numba is not None:
    _i64, _ptr = types.int64, types.intp
    _decode_scores = types.ExternalFunction(
        SYMBOL, types.void(_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, types.float32, _ptr, _i64)
    )
    _item_signature = types.void(
        _ptr, _i64, _i64, _ptr, _ptr, _ptr, *[_i64] * 9, types.float32, types.float32, _ptr, _ptr
    )


def scores(query, key_cache, block_table, start, end, kv0, group, scale):
    """``[heads, end - start]`` float32: like the Numba ``_scores`` (query ``[heads, head_dim]``
    float32 holding bfloat16 values, contiguous rows; ``key_cache`` the bfloat16 cache viewed as
    uint16, each slot's heads contiguous; head i reads KV head ``kv0 + i // group``), one C call
    per KV head."""
    heads, head_dim = query.shape
    length = max(end - start, 0)
    out = np.empty((heads, length), np.float32)
    if length == 0:
        return out
    block_size = key_cache.shape[1]
    block_stride, row_stride = key_cache.strides[0] // 2, key_cache.strides[1] // 2
    for g in range(heads // group):
        _decode_scores(  # type: ignore[call-overload]
            query[g * group :].ctypes.data,
            group,
            key_cache.ctypes.data,
            block_table.ctypes.data,
            start,
            end,
            kv0 + g,
            block_stride,
            row_stride,
            head_dim,
            block_size,
            np.float32(scale),
            out[g * group :].ctypes.data,
            length,
        )
    return out


if numba is not None:
    scores = numba.njit(inline="always", boundscheck=False)(scores)


def _attend(query, key_cache, value_cache, block_table, start, end, kv0, group, scale, softcap, out_scale, out):
    """A whole work item in one C call, like the kernel's Numba ``_attend``: ``out``
    (``[heads, head_dim]``) = softmax(scores) @ values * ``out_scale`` over positions
    ``start .. end - 1``, caches as for :func:`scores` (an 8-bit cache as its bytes, int8 rows
    with their scale); ``query`` and ``out`` hold bfloat16 bits (uint16, contiguous rows): the
    sums are float32, rounded once. ``softcap`` is not applied: the kernel takes this path only
    without one. ``_decode_attention`` is the format's C item, bound in each copy."""
    heads, head_dim = query.shape
    scratch = np.empty(group * max(end - start, 1), np.float32)  # NOTE: one KV head's scores at a time
    _decode_attention(  # type: ignore[name-defined]  # noqa: F821
        query.ctypes.data,
        heads,
        group,
        key_cache.ctypes.data,
        value_cache.ctypes.data,
        block_table.ctypes.data,
        start,
        end,
        kv0,
        key_cache.strides[0],
        key_cache.strides[1],
        value_cache.strides[0],
        value_cache.strides[1],
        head_dim,
        key_cache.shape[1],
        np.float32(scale),
        np.float32(out_scale),
        scratch.ctypes.data,
        out.ctypes.data,
    )


@functools.cache
def attend_for(cache_dtype: torch.dtype):
    """The Numba device function running :func:`_attend` with the C item of ``cache_dtype``
    (a key of :data:`ITEM_SYMBOLS`): what the decode kernel's copies take as ``_attend``."""
    symbol = ITEM_SYMBOLS[cache_dtype]
    if not format_available(cache_dtype):  # NOTE: a symbol never loaded would be called at address 0
        raise RuntimeError(f"the C decode item over a {cache_dtype} cache could not be built here")
    item = types.ExternalFunction(symbol, _item_signature)
    fn = FunctionType(_attend.__code__, _attend.__globals__ | {"_decode_attention": item}, f"attend_{symbol}")
    fn.__qualname__ = fn.__name__
    return numba.njit(inline="always", boundscheck=False)(fn)
