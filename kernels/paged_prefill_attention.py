"""Paged prefill / extend attention: new tokens of several sequences attend causally to
their cached prefix and to themselves (prefix caching, chunked prefill, plain prefill).

The new tokens are the LAST ``q_len`` positions of each sequence::

    seq s, context_lens[s] = 10, q_len = 4 (cu_seqlens_q[s+1] - cu_seqlens_q[s])
    positions:  0 1 2 3 4 5 | 6 7 8 9
                cached prefix | new tokens (query i sits at position 6 + i)
    query i attends to positions 0 .. 6 + i
    (with a sliding window W: positions 6 + i - W + 1 .. 6 + i; earlier blocks are not read)

Grid: ``(total_q // BLOCK_Q + num_seqs, num_kv_heads)``. Program ``b`` serves query
tile ``b - start(s)`` of the sequence ``s`` with ``start(s) <= b < start(s+1)``, where
``start(s) = cu_seqlens_q[s] // BLOCK_Q + s`` (found by binary search; the ``+ s`` leaves
room for each sequence's partial last tile). The grid needs no device sync. Each program
covers ``BLOCK_Q`` query tokens x all query heads of one KV head, so each K/V tile is
read once for the whole GQA group.
"""

from __future__ import annotations

import torch

from ._paged import (
    check_block_tables,
    check_int_vector,
    check_kv_caches,
    check_last_dim_contiguous,
    check_query,
    check_tile,
    check_window,
    gather_sequence_kv,
    soft_cap,
    window_start,
)
from ._triton import NO_WINDOW, check_can_launch, is_interpreted, next_pow2, soft_cap_log2, tl, triton
from ._triton_kv import kv_format, load_kv_tile
from .kv_quant import head_dim_of


@triton.jit
def _find_seq(cu_seqlens_q_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest s with cu_seqlens_q[s] // BLOCK_Q + s <= q_block (binary search)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs", "stride_bt_seq"])  # NOTE: step-varying: out of the compile key
def paged_prefill_attention_kernel(
    query_ptr,  # [total_q, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    context_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [total_q, num_heads, head_dim]
    scale,  # softmax scale
    k_scale,  # per-tensor scales of an fp8 cache (KV_QUANT)
    v_scale,
    softcap,  # logit soft-cap (read only when SOFTCAP)
    window,  # sliding window in positions (NO_WINDOW: none)
    num_seqs,
    head_dim,
    stride_q_tok,
    stride_q_head,
    stride_kc_blk,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_blk,
    stride_vc_slot,
    stride_vc_head,
    stride_bt_seq,
    stride_o_tok,
    stride_o_head,
    QUERIES_PER_KV: tl.constexpr,
    KV_QUANT: tl.constexpr,  # _triton_kv: KV_PLAIN, KV_FP8 or KV_INT8
    block_size: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    seq = _find_seq(cu_seqlens_q_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_tile = q_block - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq64 = seq.to(tl.int64)
    context_len = tl.load(context_lens_ptr + seq64)
    prefix_len = context_len - q_len

    # rows = BLOCK_Q tokens x BLOCK_G heads of this KV head's group
    m = tl.arange(0, BLOCK_Q * BLOCK_G)
    q_idx = q_tile * BLOCK_Q + m // BLOCK_G  # token index within the sequence's new tokens
    g = m % BLOCK_G
    row_mask = (q_idx < q_len) & (g < QUERIES_PER_KV)
    q_pos = prefix_len + q_idx  # absolute position of each row's token
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_mask = d < head_dim
    token = (q_start + q_idx).to(tl.int64)
    heads = kv_head * QUERIES_PER_KV + g
    q = tl.load(  # [BLOCK_M, BLOCK_D]
        query_ptr + token[:, None] * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq64 * stride_bt_seq
    k_head = key_cache_ptr + kv_head * stride_kc_head
    v_head = value_cache_ptr + kv_head * stride_vc_head
    # causal: the tile's last token sees positions < kv_end, earlier rows fewer; with a
    # window its first token sees nothing before kv_start, later rows less
    kv_end = prefix_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    kv_start = tl.maximum(prefix_len + q_tile * BLOCK_Q - window + 1, 0)
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        pos = tile_start + n  # [BLOCK_N]
        n_mask = pos < kv_end
        physical = tl.load(block_table + pos // block_size, mask=n_mask, other=0).to(tl.int64)
        slot = (pos % block_size).to(tl.int64)
        k_rows = k_head + physical[:, None] * stride_kc_blk + slot[:, None] * stride_kc_slot
        k = load_kv_tile(k_rows, d, n_mask, d_mask, k_scale, head_dim, KV_QUANT, q.dtype)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            s = soft_cap_log2(s, scale, softcap)
        else:
            s = s * (scale * 1.4426950408889634)  # log2(e): the softmax runs on exp2
        seen = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(n_mask[None, :] & seen, s, float("-inf"))
        # NOTE: a row may see no key of a tile (causal, window); shift by 0 instead of -inf
        # there so exp2 yields 0 rather than NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = v_head + physical[:, None] * stride_vc_blk + slot[:, None] * stride_vc_slot
        v = load_kv_tile(v_rows, d, n_mask, d_mask, v_scale, head_dim, KV_QUANT, q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = out_ptr + token[:, None] * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def _check_args(query, key, value, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens) -> None:
    check_kv_caches(key_cache, value_cache)
    check_query(query, key_cache)
    num_seqs = context_lens.shape[0] if context_lens.dim() == 1 else -1
    check_int_vector(context_lens, "context_lens", num_seqs)
    check_int_vector(cu_seqlens_q, "cu_seqlens_q", num_seqs + 1)
    check_block_tables(block_tables, num_seqs)
    kv_shape = (query.shape[0], key_cache.shape[2], head_dim_of(key_cache))
    for name, t in (("key", key), ("value", value)):
        if t is not None and t.shape != kv_shape:
            raise ValueError(f"{name} must be [total_q, num_kv_heads, head_dim] = {kv_shape}, got {tuple(t.shape)}")


def paged_prefill_attention_launch(
    query,
    key,
    value,
    key_cache,
    value_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    scale,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """:func:`paged_prefill_attention` with the tuning knobs exposed (tests, benchmarks).

    ``block_m`` is the number of (token, head) rows per program: ``BLOCK_Q`` tokens times
    the GQA group padded to a power of two.
    """
    check_window(sliding_window, logit_softcap)
    _check_args(query, key, value, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens)
    check_can_launch(
        paged_prefill_attention_kernel, query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens
    )
    check_last_dim_contiguous(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        cu_seqlens_q=cu_seqlens_q,
        context_lens=context_lens,
    )
    total_q, num_heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if total_q == 0 or num_seqs == 0:
        return out
    interpreted = is_interpreted(paged_prefill_attention_kernel)
    block_m = block_m or (16 if interpreted else 64)
    block_n = block_n or (16 if interpreted else 64)
    check_tile("block_m", block_m)
    check_tile("block_n", block_n)
    group = num_heads // num_kv_heads
    block_g = next_pow2(group)
    # NOTE: tl.dot needs M >= 16 on GPUs: BLOCK_Q * BLOCK_G is kept >= 16.
    block_q = max(1, block_m // block_g, 16 // block_g)
    grid = (total_q // block_q + num_seqs, num_kv_heads)
    paged_prefill_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        float(scale),
        float(k_scale),
        float(v_scale),
        float(logit_softcap or 1.0),
        NO_WINDOW if sliding_window is None else sliding_window,
        num_seqs,
        head_dim,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        QUERIES_PER_KV=group,
        KV_QUANT=kv_format(key_cache),
        block_size=block_size,
        SOFTCAP=logit_softcap is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        BLOCK_Q=block_q,
        BLOCK_G=block_g,
        BLOCK_N=block_n,
        BLOCK_D=max(16, next_pow2(head_dim)),
        num_warps=num_warps,
    )
    return out


def paged_prefill_attention(
    query: torch.Tensor,  # [total_q, num_heads, head_dim]
    key: torch.Tensor | None,  # [total_q, num_kv_heads, head_dim]
    value: torch.Tensor | None,  # [total_q, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [total_q, num_heads, head_dim]
    """Causal attention of the new tokens of several sequences over their paged K/V (Triton).

    ``query`` holds the new tokens of all sequences back to back; sequence ``s`` owns rows
    ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` (``q_len`` of them, possibly 0).
    ``context_lens[s]`` is the sequence's total length INCLUDING its new tokens, which
    are its last ``q_len`` positions: new token ``i`` is at position
    ``context_lens[s] - q_len + i`` and attends to positions ``<=`` its own, and with a
    ``sliding_window`` only to those ``> its own - sliding_window``: table entries before
    the block of the first new token's first visible position are not read.
    ``logit_softcap`` caps the scaled scores (``cap * tanh(s / cap)``).

    CONTRACT: the new tokens' K/V must ALREADY be in ``key_cache``/``value_cache``
    (written with ``reshape_and_cache`` before this call); everything, new tokens
    included, is read from the caches. ``key``/``value`` (the new tokens' K/V, or
    ``None``) are only shape-checked, for backends that would use them directly.
    Output dtype = query dtype; softmax and accumulation in float32. An 8-bit cache
    (kv_quant.py) is widened as it is read (``k_scale``/``v_scale``: an fp8 cache's scales).
    """
    return paged_prefill_attention_launch(
        query,
        key,
        value,
        key_cache,
        value_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        scale,
        sliding_window,
        logit_softcap,
        k_scale,
        v_scale,
    )


def paged_prefill_attention_reference(
    query: torch.Tensor,  # [total_q, num_heads, head_dim]
    key: torch.Tensor | None,  # [total_q, num_kv_heads, head_dim]
    value: torch.Tensor | None,  # [total_q, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [total_q, num_heads, head_dim]
    """Plain-torch twin of :func:`paged_prefill_attention` (same contract: reads the
    caches only); loops over sequences, vectorized within each."""
    check_window(sliding_window, logit_softcap)
    _check_args(query, key, value, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens)
    total_q, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    cu, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for s, length in enumerate(lens):
        q_len = cu[s + 1] - cu[s]
        if q_len == 0:
            continue
        if not q_len <= length:
            raise ValueError(f"sequence {s} has {q_len} new tokens but context_lens[{s}] = {length}")
        # the first new token's first visible position decides the first block read
        first_block = window_start(length - q_len + 1, sliding_window) // block_size
        offset = first_block * block_size
        keys = gather_sequence_kv(key_cache, block_tables[s], length, first_block, k_scale).float()  # [span, kv, d]
        values = gather_sequence_kv(value_cache, block_tables[s], length, first_block, v_scale).float()
        q = query[cu[s] : cu[s + 1]].reshape(q_len, num_kv_heads, group, head_dim).float()
        scores = soft_cap(torch.einsum("qkgd,lkd->kgql", q, keys) * scale, logit_softcap)  # [kv, group, q, span]
        q_pos = torch.arange(length - q_len, length, device=query.device)[:, None]
        k_pos = torch.arange(offset, length, device=query.device)[None, :]
        seen = k_pos <= q_pos  # [q_len, span]
        if sliding_window is not None:
            seen &= k_pos > q_pos - sliding_window
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
        seq_out = torch.einsum("kgql,lkd->qkgd", probs, values)  # [q_len, kv_heads, group, d]
        out[cu[s] : cu[s + 1]] = seq_out.reshape(q_len, num_heads, head_dim).to(query.dtype)
    return out
