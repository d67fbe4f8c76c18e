"""Paged decode attention: one new query token per sequence over its cached K/V, in one launch.

Grid: ``(num_seqs, num_kv_heads, num_splits)``. One program serves all
``num_heads // num_kv_heads`` query heads of one KV head (GQA/MQA: each K/V tile is read
once for the whole group) over one split of the context::

    context of seq s (context_lens[s] tokens, tiles of BLOCK_N positions)
    |── split 0 ──|── split 1 ──|── split 2 ──|  (split 3: empty -> lse = -inf)
         │              │             │
    partial out + log-sum-exp per (seq, head, split); the last program of (seq, KV head) to
    finish (an atomic count) merges them into ``out`` and sets the count back to 0

Small batches thus get many programs (``choose_num_splits``) without a second launch for
the merge. With a single split the kernel writes ``out`` directly and counts nothing.

Positions map to cache slots through the block table (``block_size`` is a compile-time
constant independent of BLOCK_N, so a tile may span several blocks or part of one).

With a sliding window the splits cover only the visible span
``[context_len - window, context_len)``: nothing before it is read, table entries included.

NOTE: the counts live in one zeroed int32 buffer per device (:func:`split_counters`), left
zeroed by every launch, so CUDA-graph replays need no reset; two launches must therefore
not run at once on different streams of one device.
"""

from __future__ import annotations

import functools

import torch

from ._paged import (
    check_block_tables,
    check_int_vector,
    check_kv_caches,
    check_last_dim_contiguous,
    check_query,
    check_tile,
    check_window,
    gather_blocks,
    soft_cap,
)
from ._triton import NO_WINDOW, check_can_launch, is_interpreted, next_pow2, soft_cap_log2, tl, triton
from ._triton_kv import kv_format, load_kv_tile

# NOTE: a shorter split costs more in partial-result traffic and the merge than it wins.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
# off CUDA (Triton's interpreter) a small fixed count, which also exercises the merge
INTERPRETER_SPLITS = 4
COUNTERS_MIN = 1024
"""Smallest counter buffer: (seq, KV head) pairs of a 128-row batch of 8 KV heads, grown by doubling."""


# NOTE: what varies from step to step stays out of the compile key (no compile while serving)
@triton.jit(do_not_specialize=["num_splits", "stride_bt_seq", "stride_o_seq", "stride_o_head", "stride_lse_seq",
                               "stride_lse_head"])  # fmt: skip
def paged_decode_attention_kernel(
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    context_lens_ptr,  # [num_seqs] int32
    out_ptr,  # DIRECT_OUT: [num_seqs, num_heads, head_dim]; else [num_seqs, num_heads, num_splits, head_dim] fp32
    lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, log2 domain (unused when DIRECT_OUT)
    final_ptr,  # [num_seqs, num_heads, head_dim]: where the last split merges them (unused when DIRECT_OUT)
    counter_ptr,  # [>= num_seqs * num_kv_heads] int32, zero (unused when DIRECT_OUT)
    scale,  # softmax scale
    k_scale,  # per-tensor scales of an fp8 cache (KV_QUANT)
    v_scale,
    softcap,  # logit soft-cap (read only when SOFTCAP)
    window,  # sliding window in positions (NO_WINDOW: none)
    num_splits,
    head_dim,
    stride_q_seq,
    stride_q_head,
    stride_kc_blk,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_blk,
    stride_vc_slot,
    stride_vc_head,
    stride_bt_seq,
    stride_o_seq,
    stride_o_head,
    stride_o_split,
    stride_lse_seq,
    stride_lse_head,
    stride_f_seq,
    stride_f_head,
    QUERIES_PER_KV: tl.constexpr,
    KV_QUANT: tl.constexpr,  # _triton_kv: KV_PLAIN, KV_FP8 or KV_INT8
    block_size: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    kv_start = tl.maximum(context_len - window, 0)  # the first position the query sees
    tokens_per_split = tl.cdiv(tl.cdiv(context_len - kv_start, num_splits), BLOCK_N) * BLOCK_N
    start = kv_start + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * QUERIES_PER_KV + g  # int64 [BLOCK_G]
    g_mask = g < QUERIES_PER_KV
    d_mask = d < head_dim
    q = tl.load(  # [BLOCK_G, BLOCK_D]
        query_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq * stride_bt_seq
    k_head = key_cache_ptr + kv_head * stride_kc_head
    v_head = value_cache_ptr + kv_head * stride_vc_head
    # NOTE: every tile in [start, end) holds at least one valid position, so m_new is
    # finite inside the loop; an empty split skips the loop and keeps l_i == 0.
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + n  # [BLOCK_N]
        n_mask = pos < end
        physical = tl.load(block_table + pos // block_size, mask=n_mask, other=0).to(tl.int64)
        slot = (pos % block_size).to(tl.int64)
        k_rows = k_head + physical[:, None] * stride_kc_blk + slot[:, None] * stride_kc_slot
        k = load_kv_tile(k_rows, d, n_mask, d_mask, k_scale, head_dim, KV_QUANT, q.dtype)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
        if SOFTCAP:
            s = soft_cap_log2(s, scale, softcap)
        else:
            s = s * (scale * 1.4426950408889634)  # log2(e): the softmax runs on exp2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = v_head + physical[:, None] * stride_vc_blk + slot[:, None] * stride_vc_slot
        v = load_kv_tile(v_rows, d, n_mask, d_mask, v_scale, head_dim, KV_QUANT, q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT_OUT:
        o_ptrs = out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        o_ptrs = out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + split * stride_o_split
        tl.store(o_ptrs + d[None, :], out, mask=o_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * stride_lse_seq + heads * stride_lse_head + split, lse, mask=g_mask)
        # NOTE: every thread's stores come before the count (barrier), and the count releases
        # them to the program that reads them (acq_rel at GPU scope): it sees every split's.
        tl.debug_barrier()
        counter = counter_ptr + seq * tl.num_programs(1) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:
            p_rows = out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :]
            lse_rows = lse_ptr + seq * stride_lse_seq + heads * stride_lse_head
            merged = _merge_splits(p_rows, stride_o_split, lse_rows, num_splits, o_mask, g_mask, BLOCK_G, BLOCK_D)
            f_ptrs = final_ptr + seq * stride_f_seq + heads[:, None] * stride_f_head + d[None, :]
            tl.store(f_ptrs, merged.to(final_ptr.dtype.element_ty), mask=o_mask)
            tl.atomic_xchg(counter, 0)  # NOTE: zero again for the next launch (or graph replay)


@triton.jit
def _merge_splits(p_rows, stride_split, lse_rows, num_splits, o_mask, g_mask, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr):  # fmt: skip
    """The splits' partial outputs [BLOCK_G, BLOCK_D] weighed by their log-sum-exps (log2), merged."""
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s in range(num_splits):
        # NOTE: ".cg": read from L2, where the other programs' stores are, never a stale L1 line
        lse = tl.load(lse_rows + s, mask=g_mask, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(p_rows + s * stride_split, mask=o_mask, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        # NOTE: empty splits carry lse = -inf and weigh 0; while every split so far is
        # empty the shift is 0, not -inf, so no inf - inf
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - shift)
        weight = tl.exp2(lse - shift)
        total = total * alpha + weight
        acc = acc * alpha[:, None] + weight[:, None] * part
        m = m_new
    return acc / tl.where(total == 0.0, 1.0, total)[:, None]


def _check_args(
    query, key_cache, value_cache, block_tables, context_lens, sliding_window=None, logit_softcap=None
) -> None:
    check_kv_caches(key_cache, value_cache)
    check_query(query, key_cache)
    check_block_tables(block_tables, query.shape[0])
    check_int_vector(context_lens, "context_lens", query.shape[0])
    check_window(sliding_window, logit_softcap)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, block_n: int, num_sms: int) -> int:
    """Splits per (seq, KV head): enough programs for ~4 per multiprocessor, none shorter
    than ``MIN_TOKENS_PER_SPLIT``, at most ``MAX_SPLITS``; a power of two so that few
    kernel variants get compiled.

    ``max_context_len`` is an upper bound taken from shapes (max_blocks * block_size), so
    the choice needs no device sync and is stable under CUDA-graph capture.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = -(-4 * num_sms // programs)
    by_length = max(1, max_context_len // max(MIN_TOKENS_PER_SPLIT, block_n))
    splits = max(1, min(wanted, by_length, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


_multiprocessor_count = functools.cache(lambda device: torch.cuda.get_device_properties(device).multi_processor_count)
_counters: dict[torch.device, torch.Tensor] = {}
_retired: list[torch.Tensor] = []


def split_counters(device: torch.device, pairs: int) -> torch.Tensor:
    """The zeroed int32 counts the kernel's splits take turns on, at least ``pairs`` of them.

    One buffer per device, kept: the kernel leaves it zeroed. Grown (doubling, from
    :data:`COUNTERS_MIN`) only when a launch needs more, which a GPU of up to 256
    multiprocessors never does: ``choose_num_splits`` splits only batches of fewer than
    4 programs per multiprocessor (sequences x KV heads).
    """
    counters = _counters.get(device)
    if counters is None or counters.numel() < pairs:
        if counters is not None:  # NOTE: a captured graph may still address it: never freed
            _retired.append(counters)
        counters = torch.zeros(max(COUNTERS_MIN, next_pow2(pairs)), dtype=torch.int32, device=device)
        _counters[device] = counters
    return counters


def paged_decode_attention_launch(
    query,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    scale,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """:func:`paged_decode_attention` with the tuning knobs exposed (tests, benchmarks)."""
    _check_args(query, key_cache, value_cache, block_tables, context_lens, sliding_window, logit_softcap)
    check_can_launch(paged_decode_attention_kernel, query, key_cache, value_cache, block_tables, context_lens)
    check_last_dim_contiguous(
        query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables, context_lens=context_lens
    )
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1:3]
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    if block_n is None:
        block_n = 16 if is_interpreted(paged_decode_attention_kernel) else 64
    check_tile("block_n", block_n)
    if num_splits is None and query.device.type != "cuda":
        num_splits = INTERPRETER_SPLITS
    elif num_splits is None:
        num_sms = _multiprocessor_count(query.device.index or 0)
        max_len = block_tables.shape[1] * block_size
        if sliding_window is not None:
            max_len = min(max_len, sliding_window)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_len, block_n, num_sms)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    group = num_heads // num_kv_heads
    block_d = max(16, next_pow2(head_dim))  # tl.dot needs K >= 16
    direct = num_splits == 1
    if direct:
        partial, lse, counters = out, out, out  # NOTE: only ``out`` is written when DIRECT_OUT
        p_strides, lse_strides = (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        partial = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        counters = split_counters(query.device, num_seqs * num_kv_heads)
        p_strides = (partial.stride(0), partial.stride(1), partial.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1))
    paged_decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, context_lens, partial, lse, out, counters,
        float(scale), float(k_scale), float(v_scale), float(logit_softcap or 1.0),
        NO_WINDOW if sliding_window is None else sliding_window, num_splits, head_dim,
        query.stride(0), query.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3], block_tables.stride(0),
        *p_strides, *lse_strides, out.stride(0), out.stride(1),
        QUERIES_PER_KV=group,
        KV_QUANT=kv_format(key_cache),
        block_size=block_size,
        DIRECT_OUT=direct,
        SOFTCAP=logit_softcap is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        BLOCK_G=max(16, next_pow2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )  # fmt: skip
    return out


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of each sequence's single new query over its paged K/V (Triton).

    ``context_lens[s]`` counts the tokens in the cache for sequence ``s``, the current
    one included (its K/V must already be written with ``reshape_and_cache``). Only the
    entries of ``block_tables[s]`` for visible positions are read: from the block of
    position ``context_lens[s] - sliding_window`` (0 without a window) to that of the
    last position; the rest may hold anything. A sequence with ``context_lens[s] == 0``
    gets zeros. ``logit_softcap`` caps the scaled scores (``cap * tanh(s / cap)``).
    ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA/MQA). Output in the query's dtype,
    softmax and sums in float32; an 8-bit cache (kv_quant.py) is widened as it is read.
    """
    args = (query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window, logit_softcap)
    return paged_decode_attention_launch(*args, k_scale, v_scale)


def paged_decode_attention_reference(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Plain-torch twin of :func:`paged_decode_attention`, vectorized over sequences."""
    _check_args(query, key_cache, value_cache, block_tables, context_lens, sliding_window, logit_softcap)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_seqs == 0:
        return torch.empty_like(query)
    lens = context_lens.long()
    # [num_seqs] the first position each query sees
    starts = torch.zeros_like(lens) if sliding_window is None else (lens - sliding_window).clamp(min=0)
    first_blocks = starts // block_size
    end_blocks = -(-lens // block_size)
    num_blocks = int((end_blocks - first_blocks).max())
    if num_blocks == 0:
        return torch.zeros_like(query)
    # Row s reads table columns first_blocks[s] .. end_blocks[s] - 1. NOTE: other entries may be garbage
    # (past the context, freed before the window): read as the first visible block, zeroed below.
    cols = first_blocks[:, None] + torch.arange(num_blocks, device=query.device)  # [num_seqs, num_blocks]
    needed = cols < end_blocks[:, None]
    cols = torch.where(needed, cols, first_blocks[:, None]).clamp(max=block_tables.shape[1] - 1)
    tables = block_tables.long().gather(1, cols)
    first = torch.where(lens > 0, tables[:, 0], 0)[:, None]
    tables = torch.where(needed, tables, first).view(-1)
    length = num_blocks * block_size
    keys = gather_blocks(key_cache, tables, k_scale).view(num_seqs, length, num_kv_heads, head_dim)
    values = gather_blocks(value_cache, tables, v_scale).view(num_seqs, length, num_kv_heads, head_dim)
    pos = first_blocks[:, None] * block_size + torch.arange(length, device=query.device)  # [num_seqs, length]
    valid = (pos >= starts[:, None]) & (pos < lens[:, None])
    # NOTE: slots outside the span may hold anything, NaN too (0 * NaN = NaN): those rows are zeroed.
    tail_rows = (~valid).view(-1).nonzero().view(-1)
    keys.view(-1, num_kv_heads, head_dim).index_fill_(0, tail_rows, 0.0)
    values.view(-1, num_kv_heads, head_dim).index_fill_(0, tail_rows, 0.0)
    # The query heads of one KV head play the part of a query sequence of length `group`:
    #   q [num_seqs, kv_heads, group, d] x k, v [num_seqs, length, kv_heads, d]
    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
    scores = soft_cap(torch.einsum("skgd,slkd->skgl", q, keys) * scale, logit_softcap)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("skgl,slkd->skgd", torch.softmax(scores, dim=-1), values)
    out = out.masked_fill((lens == 0)[:, None, None, None], 0.0)  # empty contexts: zeros, not NaN
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)
