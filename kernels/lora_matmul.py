"""Batched multi-LoRA matmul: each token runs the adapter of its slot, in one launch per projection.

Adapters live in stacked tensors, one row per slot; slot 0 holds no adapter (its tokens
are skipped, so base-model requests cost nothing here)::

    a: [slots, R, K]   (lora_A, zero-padded to the largest rank R)
    b: [slots, N, R]   (lora_B * scaling, zero-padded)
    token_slots: [T]   the slot of each token of the step

    shrink:  xa[t] = x[t] @ a[s].T            [T, R] float32   (s = token_slots[t])
    expand:  y[t] += xa[t] @ b[s].T           in place, y's dtype

The two halves are separate so a row-parallel layer can all-reduce ``xa`` (R wide)
between them. On CUDA the Triton kernels run one program per token (and output block);
the references group tokens by slot once per step (:func:`plan_slots`) and run one
matmul pair per slot (the CPU path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import check_can_launch, next_pow2, tl, triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Segment:
    """The tokens of one slot: rows ``rows`` of the grouped tokens, and the slot's rank."""

    slot: int
    rows: slice
    rank: int


@dataclass(frozen=True)
class SlotPlan:
    """A step's adapter tokens grouped by slot, built once on the host and shared by every layer.

    ``order`` lists the adapter tokens (slot 0 left out) sorted by slot; each segment is a run
    of it. ``order`` is None when the step's tokens already come grouped (each slot's tokens
    one run, in slot order: a lone prefill, one adapter for the batch): segments then slice
    the tokens themselves, with no gather or scatter::

        token_slots  2 2 0 1 1 1 2     order = [3 4 5 0 1 6]   segments: slot 1 rows 0:3, slot 2 rows 3:6
    """

    order: torch.Tensor | None
    segments: list[Segment]


def plan_slots(token_slots: torch.Tensor, ranks: list[int] | None = None) -> SlotPlan:
    """Group the step's tokens by slot; ``ranks[s]`` bounds the columns slot ``s`` uses (all if None)."""
    slots = token_slots.cpu()
    order = torch.argsort(slots, stable=True)
    sorted_slots = slots[order]
    first = int(torch.searchsorted(sorted_slots, 1))
    order = order[first:]
    values, counts = torch.unique_consecutive(sorted_slots[first:], return_counts=True)
    segments, start = [], 0
    for slot, count in zip(values.tolist(), counts.tolist()):
        segments.append(Segment(slot, slice(start, start + count), ranks[slot] if ranks is not None else -1))
        start += count
    grouped = order.numel() == 0 or bool((order[1:] - order[:-1] == 1).all())
    if grouped:
        offset = int(order[0]) if order.numel() else 0
        shifted = [Segment(g.slot, slice(g.rows.start + offset, g.rows.stop + offset), g.rank) for g in segments]
        return SlotPlan(None, shifted)
    return SlotPlan(order.to(token_slots.device), segments)


def _check(x: torch.Tensor, w: torch.Tensor, token_slots: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or w.dim() != 3 or token_slots.shape != (x.shape[0],):
        raise ValueError(
            f"{what}: expected x [tokens, features], stacked weights [slots, rows, cols] and token_slots "
            f"[tokens], got {tuple(x.shape)}, {tuple(w.shape)}, {tuple(token_slots.shape)}"
        )
    if token_slots.dtype != torch.int64:
        raise ValueError(f"{what}: token_slots must be int64, got {token_slots.dtype}")
    if w.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{what}: weights must be float16, bfloat16 or float32, got {w.dtype}")


@triton.jit
def lora_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [slots, R, K]
    out_ptr,  # [T, R] float32, zeroed
    slots_ptr,  # [T] int64
    R,
    K,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ot,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot == 0:
        return
    rs = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_xt + ks, mask=ks < K, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + slot * stride_as + rs[:, None] * stride_ar + ks[None, :],
            mask=(rs[:, None] < R) & (ks[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(out_ptr + t * stride_ot + rs, acc, mask=rs < R)


@triton.jit
def lora_expand_kernel(
    xa_ptr,  # [T, R] float32
    b_ptr,  # [slots, N, R]
    y_ptr,  # [T, N], added to in place
    slots_ptr,  # [T] int64
    N,
    R,
    stride_xat,
    stride_bs,
    stride_bn,
    stride_yt,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot == 0:
        return
    ns = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    xa = tl.load(xa_ptr + t * stride_xat + rs, mask=rs < R, other=0.0)
    b = tl.load(
        b_ptr + slot * stride_bs + ns[:, None] * stride_bn + rs[None, :],
        mask=(ns[:, None] < N) & (rs[None, :] < R),
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(b * xa[None, :], axis=1)
    y = y_ptr + t * stride_yt + ns
    old = tl.load(y, mask=ns < N, other=0.0).to(tl.float32)
    tl.store(y, (old + delta).to(y_ptr.dtype.element_ty), mask=ns < N)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """``xa[t] = x[t] @ a[token_slots[t]].T`` (Triton): [T, R] float32, zero for slot 0."""
    _check(x, a, token_slots, "lora_shrink")
    check_can_launch(lora_shrink_kernel, x, a, token_slots)
    num_tokens, k = x.shape
    r = a.shape[1]
    if a.shape[2] != k:
        raise ValueError(f"lora_shrink: a {tuple(a.shape)} does not take {k} input features")
    x, a = x.contiguous(), a.contiguous()
    out = torch.zeros(num_tokens, r, dtype=torch.float32, device=x.device)
    if num_tokens:
        lora_shrink_kernel[(num_tokens,)](
            x, a, out, token_slots, r, k, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
            BLOCK_R=max(16, next_pow2(r)), BLOCK_K=min(128, max(16, next_pow2(k))),
        )  # fmt: skip
    return out


def lora_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor) -> None:
    """``y[t] += xa[t] @ b[token_slots[t]].T`` in place (Triton); slot-0 rows are left alone."""
    _check(y, b, token_slots, "lora_expand")
    check_can_launch(lora_expand_kernel, y, xa, b, token_slots)
    num_tokens, n = y.shape
    r = b.shape[2]
    if b.shape[1] != n or xa.shape != (num_tokens, r) or not y.is_contiguous():
        raise ValueError(f"lora_expand: y {tuple(y.shape)}, xa {tuple(xa.shape)}, b {tuple(b.shape)} do not fit")
    b, xa = b.contiguous(), xa.float().contiguous()
    block_n = min(128, max(16, next_pow2(n)))
    if num_tokens:
        lora_expand_kernel[(num_tokens, triton.cdiv(n, block_n))](
            xa, b, y, token_slots, n, r, xa.stride(0), b.stride(0), b.stride(1), y.stride(0),
            BLOCK_N=block_n, BLOCK_R=max(16, next_pow2(r)),
        )  # fmt: skip


def lora_shrink_reference(
    x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, plan: SlotPlan | None = None
) -> torch.Tensor:
    """Plain-torch :func:`lora_shrink`: one matmul per slot over its grouped tokens (its rank's columns only)."""
    _check(x, a, token_slots, "lora_shrink_reference")
    plan = plan if plan is not None else plan_slots(token_slots)
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    grouped_x = x if plan.order is None else x[plan.order]
    grouped = out if plan.order is None else out.new_zeros(plan.order.numel(), a.shape[1])
    for seg in plan.segments:
        r = seg.rank if seg.rank >= 0 else a.shape[1]
        grouped[seg.rows, :r] = (grouped_x[seg.rows] @ a[seg.slot, :r].T).float()
    if plan.order is not None:
        out.index_copy_(0, plan.order, grouped)
    return out


def lora_expand_reference(
    y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, plan: SlotPlan | None = None
) -> None:
    """Plain-torch :func:`lora_expand`: one matmul per slot, added to its tokens' rows of ``y`` in place."""
    _check(y, b, token_slots, "lora_expand_reference")
    plan = plan if plan is not None else plan_slots(token_slots)
    if plan.order is None:
        for seg in plan.segments:
            r = seg.rank if seg.rank >= 0 else b.shape[2]
            y[seg.rows] += (xa[seg.rows, :r].to(b.dtype) @ b[seg.slot, :, :r].T).to(y.dtype)
        return
    grouped_xa = xa[plan.order].to(b.dtype)
    delta = torch.empty(plan.order.numel(), y.shape[1], dtype=y.dtype, device=y.device)
    for seg in plan.segments:
        r = seg.rank if seg.rank >= 0 else b.shape[2]
        delta[seg.rows] = grouped_xa[seg.rows, :r] @ b[seg.slot, :, :r].T
    y.index_add_(0, plan.order, delta)
