"""Rotary position embedding applied in place, compiled for the CPU (Numba).

The "rotate half" layout: each head's first ``rotary_dim`` dims are two halves
``x1 | x2`` turned by the angle of the token's position (``cos``/``sin`` repeat per half)::

    x1' = x1 * cos - x2 * sin
    x2' = x2 * cos + x1 * sin          dims past rotary_dim are left as they are

The torch version builds ``cat(-x2, x1)`` and two products per tensor; this loop reads
each element once and writes it back. Without fast-math, ``x1 * cos + (-x2) * sin`` and
``x1 * cos - x2 * sin`` round identically, so the result is bitwise the reference's.
Float32 and bfloat16 (as bit patterns, see _numba_cpu.py), with float32 or bfloat16 tables;
other dtypes take :func:`rotary_reference`. In bfloat16 the kernel rounds where torch's ops
do (the table to bfloat16, each product, then the sum), so it is bitwise the reference's too.

Rows are spread over the threads from [128, 512] up (_numba_cpu.launch). Median µs of the
compiled kernel alone on [rows, 8 heads of 64], one thread / two::

    rows    float32        bfloat16
      16    1.3 /  2.2     3.5 /  3.6
      64    3.8 /  3.8    12.5 /  8.0
     512   28.7 / 17.6    96.9 / 50.6
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ._numba_cpu import KERNEL_DTYPES, compile_kernel, dtype_token, launch
from .paged_decode_attention_cpu import HAS_NUMBA

if HAS_NUMBA:
    import numba

    from ._numba_cpu import address_as, load, round_like, store_like


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


def _kernel(
    x_at, row_stride, tokens, width, cos_at, sin_at, table_rows, rotary_dim, positions_at, head_dim, like, table_like
):  # pragma: no cover
    # x_at: row t's ``width`` columns from x_at + t * row_stride elements (like's dtype);
    # cos_at, sin_at: C-contiguous [table_rows, rotary_dim] (table_like's dtype);
    # positions_at: [tokens] int64
    # NOTE: by address, not as arrays: a tensor's array costs about 1 us, as much as a decode-size call's work;
    # x flat and contiguous (not a strided 2-D view) so the loads and stores vectorise
    x = numba.carray(address_as(x_at, like), ((tokens - 1) * row_stride + width,))
    cos = numba.carray(address_as(cos_at, table_like), (table_rows, rotary_dim))
    sin = numba.carray(address_as(sin_at, table_like), (table_rows, rotary_dim))
    positions = numba.carray(address_as(positions_at, _POSITIONS), (tokens,))
    half = rotary_dim // 2
    for t in numba.prange(tokens):
        cos_row, sin_row = cos[positions[t]], sin[positions[t]]
        for head in range(width // head_dim):
            start = t * row_stride + head * head_dim
            first = x[start : start + half]
            second = x[start + half : start + 2 * half]
            for i in range(half):
                # NOTE: the table is rounded to x's dtype first, as the reference's .to(x.dtype)
                c, s = round_like(load(cos_row[i]), x), round_like(load(sin_row[i]), x)
                x1, x2 = load(first[i]), load(second[i])
                first[i] = store_like(round_like(x1 * c, x) - round_like(x2 * s, x), x)
                second[i] = store_like(round_like(x2 * c, x) + round_like(x1 * s, x), x)


_POSITIONS = np.empty((0,), np.int64)


@functools.cache
def _compiled(parallel: bool):
    return compile_kernel(_kernel, parallel, fastmath=False)


def rotary_cpu_(
    x: torch.Tensor,  # [tokens, heads * head_dim]
    cos: torch.Tensor,  # [max_positions, rotary_dim]
    sin: torch.Tensor,  # [max_positions, rotary_dim]
    positions: torch.Tensor,  # [tokens] int64
    head_dim: int,
) -> torch.Tensor:
    """:func:`rotary_reference`, in place on a float32 or bfloat16 CPU ``x`` with unit-stride rows
    (a column slice of a fused projection's output is fine), returned, with float32 or bfloat16
    tables; a new tensor otherwise."""
    # NOTE: called once per layer on a row or a few, where the kernel takes about a microsecond:
    # the checks are written out rather than looped over the tensors.
    if not HAS_NUMBA or x.dtype not in KERNEL_DTYPES or cos.dtype not in KERNEL_DTYPES or sin.dtype != cos.dtype:
        return rotary_reference(x, cos, sin, positions, head_dim)
    if not (x.is_cpu and cos.is_cpu and sin.is_cpu and positions.is_cpu) or x.dim() != 2 or x.stride(-1) != 1:
        return rotary_reference(x, cos, sin, positions, head_dim)
    if x.requires_grad and torch.is_grad_enabled():
        return rotary_reference(x, cos, sin, positions, head_dim)
    if sin.shape != cos.shape or cos.dim() != 2 or positions.shape != x.shape[:1]:
        return rotary_reference(x, cos, sin, positions, head_dim)
    if x.shape[0] == 0:
        return x
    cos, sin = cos.contiguous(), sin.contiguous()
    where = (positions if positions.dtype == torch.int64 else positions.long()).contiguous()
    tokens, width = x.shape
    launch(_compiled, tokens * width)(
        x.data_ptr(), x.stride(0), tokens, width, cos.data_ptr(), sin.data_ptr(), cos.shape[0], cos.shape[1],
        where.data_ptr(), head_dim, dtype_token(x.dtype), dtype_token(cos.dtype),
    )  # fmt: skip
    return x
