"""Mixture-of-experts feed-forward over routed tokens: each expert runs once over the rows
routed to it, as a grouped matmul.

The routing gives each (token, slot) pair ``p = token * top_k + slot`` an expert and a
weight. Pairs are sorted by expert and each expert's run is padded to a whole number of
``BLOCK_M`` rows, so every row tile of the kernel belongs to one expert::

    experts of the pairs, sorted:  e0 e0 e0 | e1 | e3 e3           (e2: no pairs)
    padded to BLOCK_M = 4:         p p p - | p - - - | p p - -     (- = padding, masked off)
    tile_expert:                   0         1         3

    h = x[p // top_k] @ w13[e].T               [pairs, 2 * intermediate]   (kernel)
    a = act(h[:, :inter]) * h[:, inter:]        [pairs, intermediate]       (torch)
    y[p] = weight[p] * (a[p] @ w2[e].T)         [pairs, hidden] float32     (kernel)
    out = y.view(tokens, top_k, hidden).sum(1)

Expert ids outside ``[0, num_local_experts)`` belong to other tensor-parallel ranks: their
pairs are left out (their rows of ``y`` stay zero). The tiling plan is built with torch
ops on the device (no host synchronisation): the grid is sized for the worst case and
tiles past the last expert's run exit at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.functional import linear

from ._triton import check_can_launch, next_pow2, tl, triton

Activation = Callable[[torch.Tensor], torch.Tensor]
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_M = 16


@triton.jit
def grouped_matmul_kernel(
    a_ptr,  # [rows, K]; pair p reads row p // a_rows_per_row
    w_ptr,  # [num_local_experts, N, K]
    c_ptr,  # [num_pairs, N]; pair p writes row p
    sorted_pairs_ptr,  # [num_tiles * BLOCK_M] int64, pairs by expert, padding = num_pairs
    tile_expert_ptr,  # [num_tiles] int64, -1 past the last run
    scale_ptr,  # [num_pairs] float32 (read only if HAS_SCALE)
    num_pairs,
    a_pairs_per_row,
    N,
    K,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_cm,
    stride_cn,
    HAS_SCALE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = tl.where(valid, pairs, 0) // a_pairs_per_row
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
            mask=valid[:, None] & (ks[None, :] < K),
            other=0.0,
        )
        # w tile, read transposed: [BLOCK_K, BLOCK_N]
        w = tl.load(
            w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
            mask=(cols[None, :] < N) & (ks[:, None] < K),
            other=0.0,
        )
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + pairs, mask=valid, other=0.0)[:, None]
    c = c_ptr + pairs[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def _check_args(x, w13, w2, weights, experts) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"expected x [tokens, hidden], w13 [experts, 2*inter, hidden], w2 [experts, hidden, inter], got "
            f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    num_experts, two_inter, hidden = w13.shape
    if x.shape[1] != hidden or two_inter % 2 or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(
            f"shapes do not fit together: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
        )
    if x.dtype not in _FLOAT_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"x, w13 and w2 must share one float dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if weights.shape != experts.shape or weights.shape[0] != x.shape[0] or weights.dim() != 2:
        raise ValueError(
            f"weights and experts must both be [tokens, top_k] for {x.shape[0]} tokens, got "
            f"{tuple(weights.shape)} and {tuple(experts.shape)}"
        )
    if weights.dtype != torch.float32 or experts.dtype != torch.int64:
        raise ValueError(f"weights must be float32 and experts int64, got {weights.dtype} and {experts.dtype}")


def tile_plan(experts: torch.Tensor, num_local_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [num_tiles * block_m], tile_expert [num_tiles]) for the routed pairs.

    Built on the device without reading anything back: ``num_tiles`` is the bound
    ``ceil(pairs / block_m) + num_local_experts``; unused slots hold ``num_pairs`` and
    unused tiles expert -1.
    """
    flat = experts.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    num_tiles = -(-num_pairs // block_m) + num_local_experts
    mine = (flat >= 0) & (flat < num_local_experts)
    key = torch.where(mine, flat, num_local_experts)  # NOTE: other ranks' pairs sort last and are dropped
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_local_experts + 1)[:num_local_experts]
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    run_start = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    slot_start = (tile_end - tiles) * block_m  # first padded slot of each expert
    sorted_key = key[order]
    keep = sorted_key < num_local_experts
    expert_of = sorted_key.clamp(max=num_local_experts - 1)
    slot = slot_start[expert_of] + torch.arange(num_pairs, device=device) - run_start[expert_of]
    sorted_pairs = torch.full((num_tiles * block_m,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs[slot[keep]] = order[keep]
    tile_expert = torch.searchsorted(tile_end, torch.arange(num_tiles, device=device), right=True)
    tile_expert = torch.where(tile_expert < num_local_experts, tile_expert, -1)
    return sorted_pairs, tile_expert


def _grouped_matmul(a, w, out, plan, a_pairs_per_row: int, scale: torch.Tensor | None) -> None:
    sorted_pairs, tile_expert = plan
    n, k = w.shape[1], w.shape[2]
    block_n = min(64, max(16, next_pow2(n)))
    block_k = min(64, max(16, next_pow2(k)))
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    grouped_matmul_kernel[grid](
        a,
        w,
        out,
        sorted_pairs,
        tile_expert,
        scale if scale is not None else out,
        out.shape[0],
        a_pairs_per_row,
        n,
        k,
        a.stride(0),
        a.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        HAS_SCALE=scale is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def fused_moe(
    x: torch.Tensor,  # [tokens, hidden]
    w13: torch.Tensor,  # [num_local_experts, 2 * inter, hidden]: gate_proj rows, then up_proj rows
    w2: torch.Tensor,  # [num_local_experts, hidden, inter]
    weights: torch.Tensor,  # [tokens, top_k] float32
    experts: torch.Tensor,  # [tokens, top_k] int64, local ids; others belong to other ranks
    act: Activation,
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])`` over this rank's experts (Triton).

    Returns [tokens, hidden] in x's dtype; the weighted sum is taken in float32.
    """
    _check_args(x, w13, w2, weights, experts)
    check_can_launch(grouped_matmul_kernel, x, w13, w2, weights, experts)
    tokens, top_k = experts.shape
    inter = w2.shape[2]
    plan = tile_plan(experts, w13.shape[0], BLOCK_M)
    h = torch.empty(tokens * top_k, 2 * inter, dtype=x.dtype, device=x.device)
    _grouped_matmul(x, w13, h, plan, top_k, None)
    a = act(h[:, :inter]) * h[:, inter:]
    y = torch.zeros(tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    _grouped_matmul(a, w2, y, plan, 1, weights.reshape(-1))
    return y.view(tokens, top_k, x.shape[1]).sum(dim=1).to(x.dtype)


def fused_moe_reference(
    x: torch.Tensor,  # [tokens, hidden]
    w13: torch.Tensor,  # [num_local_experts, 2 * inter, hidden]
    w2: torch.Tensor,  # [num_local_experts, hidden, inter]
    weights: torch.Tensor,  # [tokens, top_k] float32
    experts: torch.Tensor,  # [tokens, top_k] int64, local ids; others belong to other ranks
    act: Activation,
) -> torch.Tensor:
    """Plain-torch twin of :func:`fused_moe`: pairs sorted by expert, one matmul pair per
    expert over its contiguous rows, results added back by token."""
    _check_args(x, w13, w2, weights, experts)
    inter = w2.shape[2]

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = linear(rows, w13[expert]).split(inter, dim=-1)
        return linear(act(gate) * up, w2[expert])

    return grouped_experts(x, weights, experts, w13.shape[0], expert_mlp)


def grouped_experts(
    x: torch.Tensor,  # [tokens, hidden]
    weights: torch.Tensor,  # [tokens, top_k] float32
    experts: torch.Tensor,  # [tokens, top_k] int64, local ids; others belong to other ranks
    num_local: int,
    expert_mlp: Callable[[int, torch.Tensor], torch.Tensor],  # (local expert, rows [r, hidden]) -> [r, hidden]
) -> torch.Tensor:  # [tokens, hidden] in x's dtype
    """``sum_j weights[t, j] * expert_mlp(experts[t, j], x[t])``: the (token, slot) pairs sorted by
    expert, ``expert_mlp`` called once per expert on its contiguous rows, the weighted rows added
    back by token in float32. Any per-expert weights (plain or quantized) run through it."""
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    pairs = torch.nonzero((flat >= 0) & (flat < num_local)).squeeze(1)
    pairs = pairs[torch.argsort(flat[pairs], stable=True)]
    counts = torch.bincount(flat[pairs], minlength=num_local).tolist()
    tokens = pairs // top_k
    grouped = x[tokens]
    rows = torch.empty_like(grouped)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows[start : start + count] = expert_mlp(expert, grouped[start : start + count])
        start += count
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, rows.float() * weights.reshape(-1)[pairs, None])
    return out.to(x.dtype)
