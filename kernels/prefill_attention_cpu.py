"""Causal prefill attention over a bfloat16 or 8-bit paged cache in C (kernels/prefill_attention_cpu.c).

Each prompt chunk's new query rows attend to its context read through the block table (the
model writes the new K/V into the cache first), flash-attention style: K/V tiles of 64
positions, online softmax in float32, scores by VDPBF16PS with the query heads of a KV head
sharing each tile (GQA), and P·V as float32 FMAs on V widened exactly from bfloat16 (the
probabilities are not rounded to bfloat16). Optional sliding window; soft-capped scores stay
on the torch path (:func:`applies`).

8-bit caches (kernels/kv_quant.py) are read in place: K widened exactly to bfloat16 for the
same scores, an int8 row's scale applied to its scores and its V row, an fp8 cache's
per-tensor scales folded into the score scale and the output. Each cache format has its own
compiled copy of the kernel (and its own Numba caller).

::

    chunk (context_len, q_len) -> items (KV head, run of query tokens)  ──► dealt to threads,
    the costliest first, each to the thread with the least work so far ──► Numba ``prange``
    over the threads, each calling the C kernel on its items (no Python per item)

The C source is compiled on first use like the bf16 GEMM's (kernels/_cpu_compile.py);
:func:`available` is false, and callers keep SDPA, without AVX-512-BF16, Numba or a C
compiler, or with ``PAGEDLLM_CPU_GEMM=0``. :func:`prefill_attention_cpu_reference` is the oracle.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

try:
    import numba
    from numba import types
except ImportError:  # pragma: no cover - numba is a dependency; this keeps the package importable
    numba = None  # type: ignore[assignment]

from ._cpu_compile import AVX512_BF16_CFLAGS, build_library, cpu_has_avx512_bf16
from ._cpu_items import ITEMS_PER_THREAD, _use_threads, deal_by_cost
from ._cpu_widen import E4M3_FACTOR
from .kv_quant import C_FORMAT_NAMES, FP8_DTYPES, dequantize, head_dim_of, raw, row_width

__all__ = ["applies", "available", "prefill_attention_cpu", "prefill_attention_cpu_reference"]

SOURCE = Path(__file__).with_suffix(".c")
SYMBOLS = {dtype: f"pagedllm_prefill_attention_{name}" for dtype, name in C_FORMAT_NAMES.items()}
"""The kernel's copy for each cache dtype."""
MAX_HEAD_DIM = 256
ITEM_ROWS = 112
"""Query rows (tokens x query heads of a KV head) per work item: each K/V tile is transposed
and widened once for this many rows."""


@functools.cache
def available() -> bool:
    """Whether the C kernel runs here: x86-64 with AVX-512-BF16, Numba, a C compiler that
    built it, and ``PAGEDLLM_CPU_GEMM`` not ``0``."""
    return cpu_has_avx512_bf16() and build_library(SOURCE, AVX512_BF16_CFLAGS) is not None


def applies(query: torch.Tensor, key_cache: torch.Tensor, logit_softcap: float | None = None) -> bool:
    """Whether :func:`prefill_attention_cpu` takes these: bfloat16 query, bfloat16 or 8-bit
    cache on the CPU, head_dim a multiple of 64 up to 256, blocks of a multiple of 16, no soft-cap."""
    head_dim = query.shape[-1]
    return (
        logit_softcap is None
        and query.device.type == "cpu"
        and query.dtype == torch.bfloat16
        and key_cache.dtype in SYMBOLS
        and head_dim_of(key_cache) == head_dim
        and head_dim % 64 == 0
        and head_dim <= MAX_HEAD_DIM
        and key_cache.shape[1] % 16 == 0
        and query.shape[1] % key_cache.shape[2] == 0
        and available()
    )


def prefill_attention_cpu(
    query: torch.Tensor,  # [total_q, num_heads, head_dim] bfloat16
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, row] bfloat16 or 8-bit
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, row] key_cache's dtype
    block_tables: torch.Tensor,  # [num_chunks, max_blocks] int32
    chunks: Sequence[tuple[int, int, int]],  # (first row, end row, context_len) per chunk
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,  # [total_q, num_heads, head_dim] bfloat16, rows of a token contiguous
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [total_q, num_heads, head_dim] bfloat16
    """Each chunk's rows ``start:end`` of ``query`` (positions ``context_len - (end - start)`` on)
    over its context, read from the cache through its block table; causal, within the window.
    ``k_scale``/``v_scale``: an fp8 cache's per-tensor scales (unused by other formats; a
    cache's ``row`` is ``kv_quant.row_width``). Written into ``out`` (a new tensor if None);
    rows outside every chunk are left as they were."""
    total_q, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if not applies(query, key_cache) or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"the C prefill attention takes a bfloat16 query over bfloat16 or 8-bit caches, head_dim a multiple "
            f"of 64 up to {MAX_HEAD_DIM}, blocks a multiple of 16: got {query.dtype} {tuple(query.shape)}, "
            f"{key_cache.dtype} {tuple(key_cache.shape)}, value cache {value_cache.dtype}"
        )
    fp8 = key_cache.dtype in FP8_DTYPES
    factor = E4M3_FACTOR if key_cache.dtype == torch.float8_e4m3fn else 1.0
    score_scale, out_scale = (scale * k_scale * factor, v_scale * factor) if fp8 else (scale, 1.0)
    if not score_scale > 0:
        raise ValueError(f"the C prefill attention takes a positive scale, got {scale} (k_scale {k_scale})")
    for s, (start, end, length) in enumerate(chunks):
        if not 0 <= start <= end <= total_q or end - start > length:
            raise ValueError(f"chunk {s}: rows {start}:{end} of {total_q} with context_len {length}")
    q = query if query.stride(2) == 1 and query.stride(1) == head_dim else query.contiguous()
    width = row_width(key_cache.dtype, head_dim)
    kc, vc = (raw(c) for c in (key_cache, value_cache))  # NOTE: torch copies float8 tensors as bytes only
    kc, vc = (c if c.stride(3) == 1 and c.stride(2) == width else c.contiguous() for c in (kc, vc))
    tables = block_tables.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty(total_q, num_heads, head_dim, dtype=torch.bfloat16)
    elif out.shape != query.shape or out.dtype != torch.bfloat16 or out.stride(2) != 1 or out.stride(1) != head_dim:
        raise ValueError(f"out must be bfloat16 {tuple(query.shape)} with each token's heads contiguous")
    threads = _use_threads(torch.get_num_threads())
    items = _work_items(chunks, num_kv_heads, num_heads // num_kv_heads, threads)
    if len(items) == 0:
        return out
    window = 0 if sliding_window is None else sliding_window
    size = kc.element_size()
    caches = [kc.data_ptr(), kc.stride(0) * size, kc.stride(1) * size, vc.data_ptr(), vc.stride(0) * size]
    caches += [vc.stride(1) * size, width * size]
    failed = _run(SYMBOLS[key_cache.dtype])(
        items,
        _deal(items, threads, window),
        q.data_ptr(),
        q.stride(0),
        out.data_ptr(),
        out.stride(0),
        np.array(caches, np.int64),
        tables.data_ptr(),
        tables.stride(0),
        key_cache.shape[1],
        head_dim,
        num_heads // num_kv_heads,
        window,
        np.float32(score_scale),
        np.float32(out_scale),
    )
    if failed:
        raise MemoryError("the C prefill attention could not allocate its work buffers")
    return out


def _work_items(chunks: Sequence[tuple[int, int, int]], kv_heads: int, group: int, threads: int) -> np.ndarray:
    """``[items, 6]`` int64: (chunk, first row of the chunk, first position, t0, t1, KV head);
    runs of query tokens short enough that every thread gets a few items."""
    total = sum(end - start for start, end, _ in chunks)
    tokens = max(1, ITEM_ROWS // group)
    while tokens > 4 and kv_heads * -(-total // tokens) < ITEMS_PER_THREAD * threads:
        tokens //= 2
    parts = []
    for c, (start, end, length) in enumerate(chunks):
        t0 = np.repeat(np.arange(0, end - start, tokens, dtype=np.int64), kv_heads)
        part = np.empty((len(t0), 6), np.int64)
        part[:, :3] = (c, start, length - (end - start))
        part[:, 3], part[:, 4] = t0, np.minimum(t0 + tokens, end - start)
        part[:, 5] = np.tile(np.arange(kv_heads), len(t0) // kv_heads)
        parts.append(part)
    return np.concatenate(parts) if parts else np.zeros((0, 6), np.int64)


def _deal(items: np.ndarray, threads: int, window: int) -> np.ndarray:
    """``[threads, n + 1]``: thread t runs items ``plan[t, 1 : 1 + plan[t, 0]]``, the costliest
    dealt first, each to the thread with the least work so far (NOTE: causal items differ in
    cost by how many positions they see; Numba's ``prange`` alone splits them into equal runs)."""
    seen = items[:, 2] + (items[:, 3] + items[:, 4]) // 2 + 1  # positions the item's middle token sees
    if window > 0:
        seen = np.minimum(seen, window)
    return deal_by_cost((items[:, 4] - items[:, 3]) * (seen + 16), threads)  # NOTE: + an item's fixed cost


@functools.cache
def _run(symbol: str):
    """The Numba function that runs each thread's items through the C kernel's copy ``symbol``;
    returns how many failed."""
    i64, ptr, f32 = types.int64, types.intp, types.float32
    kernel = types.ExternalFunction(
        symbol, types.int32(ptr, i64, ptr, i64, ptr, i64, i64, ptr, i64, i64, i64, ptr, *[i64] * 8, f32, f32)
    )

    def run(items, plan, q, q_stride, out, out_stride, caches, tables, table_stride, block_size, head_dim, group,
            window, scale, v_scale):  # fmt: skip
        failed = np.zeros(plan.shape[0], np.int64)
        for t in numba.prange(plan.shape[0]):
            for n in range(plan[t, 0]):
                c, row, first, t0, t1, kv = items[plan[t, n + 1]]
                failed[t] += kernel(
                    q + row * q_stride * 2, q_stride, out + row * out_stride * 2, out_stride,
                    caches[0], caches[1], caches[2], caches[3], caches[4], caches[5], caches[6],
                    tables + c * table_stride * 4, block_size, head_dim, kv, group, first, t0, t1, window, scale,
                    v_scale,
                )  # fmt: skip
        return failed.sum()

    return numba.njit(parallel=True, nogil=True, cache=False)(run)


def prefill_attention_cpu_reference(
    query: torch.Tensor,  # [total_q, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_chunks, max_blocks] int32
    chunks: Sequence[tuple[int, int, int]],
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [total_q, num_heads, head_dim] float64
    """The oracle: the same attention in float64, each chunk's context gathered whole and (an
    8-bit cache) dequantized with ``kv_quant.dequantize`` (rows outside every chunk are zeros)."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // kv_heads
    for c, (start, end, length) in enumerate(chunks):
        first = length - (end - start)  # the first new token's position
        first_block = 0 if sliding_window is None else max(0, first - sliding_window + 1) // block_size
        blocks = block_tables[c, first_block : -(-length // block_size)].long()  # NOTE: earlier ones may be freed
        offset = first_block * block_size
        span = length - offset
        keys, values = (
            dequantize(raw(c)[blocks].view(c.dtype), torch.float64, s).flatten(0, 1)[:span].repeat_interleave(group, 1)
            for c, s in ((key_cache, k_scale), (value_cache, v_scale))
        )  # [span, heads, d]
        scores = torch.einsum("qhd,khd->hqk", query[start:end].double(), keys) * scale
        q_pos = torch.arange(first, length)[:, None]
        k_pos = torch.arange(offset, length)[None, :]
        seen = k_pos <= q_pos
        if sliding_window is not None:
            seen &= k_pos > q_pos - sliding_window
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values)
    return out
