"""Rotary position embedding on q and k, in place, in one launch for CUDA (Triton).

Each head's first ``rotary_dim`` dims turn by the angle of the token's position; the rest
pass through. Two layouts pair the dims differently::

    neox ("rotate half", Hugging Face LLaMA):   pair i = (i, i + rotary_dim / 2)
    gpt-j (interleaved):                         pair i = (2i, 2i + 1)

    x' = x_a * cos_i - x_b * sin_i,    x_b' = x_b * cos_i + x_a * sin_i

The cos/sin tables are the model's: [max_positions, rotary_dim] with the two halves equal
(``cat(freqs, freqs)``, models/rope.py), so pair i reads column i. One program turns the
heads of one token (q's and k's, a block of heads each). Values are rounded where the torch
reference rounds (the table to the activations' dtype, each product, then the sum), so in
float16/bfloat16 the result is the reference's up to a fused multiply-add's last bit.
"""

from __future__ import annotations

import torch

from ._triton import check_can_launch, next_pow2, tl, triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _turn_heads(ptr, row, stride_row, heads, num_heads, head_dim, c, s, pair, pair_ok, HALF: tl.constexpr,
                IS_NEOX: tl.constexpr):  # fmt: skip
    # ptr: [tokens, num_heads * head_dim]; heads: [BLOCK_H]; c, s: [1, BLOCK_P] in x's dtype, as float32
    mask = (heads < num_heads)[:, None] & pair_ok[None, :]
    base = ptr + row * stride_row + heads.to(tl.int64)[:, None] * head_dim
    if IS_NEOX:
        first, second = base + pair[None, :], base + pair[None, :] + HALF
    else:
        first, second = base + 2 * pair[None, :], base + 2 * pair[None, :] + 1
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(second, mask=mask, other=0.0)
    dtype = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    # NOTE: each product rounded to x's dtype before the sum, as torch's ops round them
    new1 = (a * c).to(dtype).to(tl.float32) - (b * s).to(dtype).to(tl.float32)
    new2 = (b * c).to(dtype).to(tl.float32) + (a * s).to(dtype).to(tl.float32)
    tl.store(first, new1.to(dtype), mask=mask)
    tl.store(second, new2.to(dtype), mask=mask)


@triton.jit
def rotary_embedding_kernel(
    q_ptr,  # [tokens, num_q_heads * head_dim]
    k_ptr,  # [tokens, num_k_heads * head_dim]
    cos_ptr,  # [max_positions, rotary_dim]
    sin_ptr,  # [max_positions, rotary_dim]
    positions_ptr,  # [tokens] int64
    stride_q,
    stride_k,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_k_heads,
    head_dim,
    HALF: tl.constexpr,  # rotary_dim // 2
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pair = tl.arange(0, BLOCK_P)
    pair_ok = pair < HALF
    pos = tl.load(positions_ptr + row).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_cos + pair, mask=pair_ok, other=0.0)
    s = tl.load(sin_ptr + pos * stride_sin + pair, mask=pair_ok, other=0.0)
    c = c.to(q_ptr.dtype.element_ty).to(tl.float32)[None, :]
    s = s.to(q_ptr.dtype.element_ty).to(tl.float32)[None, :]
    _turn_heads(q_ptr, row, stride_q, heads, num_q_heads, head_dim, c, s, pair, pair_ok, HALF, IS_NEOX)
    _turn_heads(k_ptr, row, stride_k, heads, num_k_heads, head_dim, c, s, pair, pair_ok, HALF, IS_NEOX)


def _check_args(positions, q, k, cos, sin, head_dim) -> None:
    if q.dim() != 2 or k.dim() != 2 or q.shape[0] != k.shape[0] or q.shape[1] % head_dim or k.shape[1] % head_dim:
        raise ValueError(f"q and k must be [tokens, heads * head_dim = {head_dim}k], got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")  # fmt: skip
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype:
        raise ValueError(f"q and k must share one of {_FLOAT_DTYPES}, got {q.dtype} and {k.dtype}")
    rotary_dim = cos.shape[-1]
    if cos.dim() != 2 or sin.shape != cos.shape or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"cos and sin must be [max_positions, rotary_dim <= {head_dim}, even], got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")  # fmt: skip
    if positions.shape != (q.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"positions must be int [tokens = {q.shape[0]}], got {positions.dtype} {tuple(positions.shape)}"
        )
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def rotary_embedding(
    positions: torch.Tensor,  # [tokens] int
    q: torch.Tensor,  # [tokens, num_q_heads * head_dim], rows at any stride
    k: torch.Tensor,  # [tokens, num_k_heads * head_dim]
    cos: torch.Tensor,  # [max_positions, rotary_dim], halves equal
    sin: torch.Tensor,  # [max_positions, rotary_dim]
    head_dim: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # (q, k), rotated in place
    """Rotate every head of ``q`` and ``k`` by its token's position, in place, in one launch (Triton)."""
    _check_args(positions, q, k, cos, sin, head_dim)
    check_can_launch(rotary_embedding_kernel, positions, q, k, cos, sin)
    tokens = q.shape[0]
    num_q, num_k = q.shape[1] // head_dim, k.shape[1] // head_dim
    if tokens == 0:
        return q, k
    half = cos.shape[-1] // 2
    block_p = next_pow2(half)
    block_h = min(next_pow2(max(num_q, num_k)), max(1, 2048 // block_p))
    grid = (tokens, triton.cdiv(max(num_q, num_k), block_h))
    rotary_embedding_kernel[grid](
        q, k, cos, sin, positions, q.stride(0), k.stride(0), cos.stride(0), sin.stride(0),
        num_q, num_k, head_dim, HALF=half, IS_NEOX=is_neox, BLOCK_H=block_h, BLOCK_P=block_p,
    )  # fmt: skip
    return q, k


def rotary_embedding_reference(
    positions: torch.Tensor,  # [tokens]
    x: torch.Tensor,  # [tokens, heads * head_dim]
    cos: torch.Tensor,  # [max_positions, rotary_dim]
    sin: torch.Tensor,  # [max_positions, rotary_dim]
    head_dim: int,
    is_neox: bool = True,
) -> torch.Tensor:  # [tokens, heads * head_dim], a new tensor
    """``x``'s heads rotated by position in torch ops, either layout (neox: kernels.rotary_cpu's reference)."""
    half = cos.shape[-1] // 2
    c = cos[positions.long(), :half].to(x.dtype)[:, None, :]  # [tokens, 1, half]
    s = sin[positions.long(), :half].to(x.dtype)[:, None, :]
    heads = x.reshape(x.shape[0], -1, head_dim)
    turned = heads[..., : 2 * half]
    if is_neox:
        x1, x2 = turned[..., :half], turned[..., half:]
    else:
        x1, x2 = turned[..., 0::2], turned[..., 1::2]
    new1, new2 = x1 * c - x2 * s, x2 * c + x1 * s
    rotated = torch.cat((new1, new2), -1) if is_neox else torch.stack((new1, new2), -1).flatten(-2)
    return torch.cat((rotated, heads[..., 2 * half :]), -1).reshape(x.shape)
