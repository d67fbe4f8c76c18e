"""Rotary position embedding applied in place, compiled for the CPU (Numba).

The "rotate half" layout: each head's first ``rotary_dim`` dims are two halves
``x1 | x2`` turned by the angle of the token's position (``cos``/``sin`` repeat per half)::

    x1' = x1 * cos - x2 * sin
    x2' = x2 * cos + x1 * sin          dims past rotary_dim are left as they are

The torch version builds ``cat(-x2, x1)`` and two products per tensor; this loop reads
each element once and writes it back. Without fast-math, ``x1 * cos + (-x2) * sin`` and
``x1 * cos - x2 * sin`` round identically, so the result is bitwise the reference's.
Float32 only; other dtypes take :func:`rotary_reference`.
"""

from __future__ import annotations

import functools

import torch

from .paged_decode_attention_cpu import HAS_NUMBA

if HAS_NUMBA:
    import numba


def rotary_reference(
    x: torch.Tensor,  # [tokens, heads * head_dim]
    cos: torch.Tensor,  # [max_positions, rotary_dim]
    sin: torch.Tensor,  # [max_positions, rotary_dim]
    positions: torch.Tensor,  # [tokens] int64
    head_dim: int,
) -> torch.Tensor:  # [tokens, heads * head_dim], a new tensor
    """Each head of ``x`` rotated by its token's position (the Hugging Face layout)."""
    c, s = cos[positions].unsqueeze(1).to(x.dtype), sin[positions].unsqueeze(1).to(x.dtype)
    shape, rotary_dim = x.shape, cos.shape[-1]
    x = x.view(shape[0], -1, head_dim)
    turned, kept = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    out = turned * c + torch.cat((-turned[..., half:], turned[..., :half]), dim=-1) * s
    if kept.shape[-1]:
        out = torch.cat((out, kept), dim=-1)
    return out.reshape(shape)


def _kernel(x, cos, sin, positions, head_dim):  # pragma: no cover - compiled
    tokens, width = x.shape
    half = cos.shape[1] // 2
    for t in range(tokens):
        p = positions[t]
        for h0 in range(0, width, head_dim):
            for i in range(half):
                c, s = cos[p, i], sin[p, i]
                x1, x2 = x[t, h0 + i], x[t, h0 + half + i]
                x[t, h0 + i] = x1 * c - x2 * s
                x[t, h0 + half + i] = x2 * c + x1 * s


@functools.cache
def _compiled():
    try:
        return numba.njit(cache=True, fastmath=False, boundscheck=False)(_kernel)
    except RuntimeError:  # numba: no writable cache directory
        return numba.njit(cache=False, fastmath=False, boundscheck=False)(_kernel)


def rotary_cpu_(
    x: torch.Tensor,  # [tokens, heads * head_dim]
    cos: torch.Tensor,  # [max_positions, rotary_dim]
    sin: torch.Tensor,  # [max_positions, rotary_dim]
    positions: torch.Tensor,  # [tokens] int64
    head_dim: int,
) -> torch.Tensor:
    """:func:`rotary_reference`, in place on a float32 CPU ``x`` with unit-stride rows (a column slice of a
    fused projection's output is fine), returned; a new tensor otherwise."""
    tensors = (x, cos, sin)
    if not HAS_NUMBA or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors) or x.dim() != 2:
        return rotary_reference(x, cos, sin, positions, head_dim)
    if x.stride(-1) != 1 or positions.device.type != "cpu" or (x.requires_grad and torch.is_grad_enabled()):
        return rotary_reference(x, cos, sin, positions, head_dim)
    _compiled()(x.numpy(), cos.numpy(), sin.numpy(), positions.long().numpy(), head_dim)
    return x
