"""Residual add + RMSNorm in one pass over each row, for CUDA (Triton).

Where a decoder layer adds a sub-layer's output to the residual stream and normalises the
sum, torch runs about ten kernels (add, cast, pow, mean, add, rsqrt, mul, cast, mul); here
one program per row reads ``x`` and ``residual`` once and writes both results::

    row t:  s = x[t] + residual[t]          -> residual[t]   (the new residual stream)
            inv = rsqrt(mean(s * s) + eps)
            out = w * (s * inv)              -> x[t]          (LLaMA: normalised row cast first)
                  (s * inv) * (1 + w)                         (Gemma: in float32, cast once)

In place, as vLLM's op is: ``x`` receives the normalised rows and ``residual`` the sum.
Values are rounded where the torch references (decoder.RMSNorm, rms_norm_cpu) round: the
sum to the activations' dtype, the normalised row (LLaMA), each product; only the order of
the mean's sum differs.
"""

from __future__ import annotations

import torch

from ._triton import check_can_launch, next_pow2, tl, triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def rms_norm_kernel(
    x_ptr,  # [A, B, hidden]: row r is (r // B, r % B)
    residual_ptr,  # [A, B, hidden] (read and written only if HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    out_ptr,  # [A, B, hidden]
    B,
    hidden,
    eps,
    stride_xa,
    stride_xb,
    stride_ra,
    stride_rb,
    stride_oa,
    stride_ob,
    HAS_RESIDUAL: tl.constexpr,
    GEMMA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    a, b = row // B, row % B
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x_row = x_ptr + a * stride_xa + b * stride_xb
    s = tl.load(x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_row = residual_ptr + a * stride_ra + b * stride_rb
        s = (s.to(tl.float32) + tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)).to(s.dtype)
        tl.store(r_row + cols, s, mask=mask)
    sf = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        out = sf * inv * (1.0 + w)
    else:
        out = (sf * inv).to(s.dtype).to(tl.float32) * w
    tl.store(out_ptr + a * stride_oa + b * stride_ob + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [A, B, hidden] without a copy: 2-D rows are [rows, 1, hidden]."""
    return t.unsqueeze(1) if t.dim() == 2 else t


def _check_args(x, weight, residual) -> None:
    if x.dim() not in (2, 3) or x.dtype not in _FLOAT_DTYPES or x.shape[-1] == 0:
        raise ValueError(f"x must be [rows, hidden] or [A, B, hidden] in one of {_FLOAT_DTYPES}, got "
                         f"{x.dtype} {tuple(x.shape)}")  # fmt: skip
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [hidden = {x.shape[-1]}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x ({x.dtype} {tuple(x.shape)}), got "
                         f"{residual.dtype} {tuple(residual.shape)}")  # fmt: skip
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        if t is not None and t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def _launch(x, weight, eps, residual, out, gemma) -> None:
    check_can_launch(rms_norm_kernel, x, weight, *([residual] if residual is not None else []))
    x3, o3 = _as_3d(x), _as_3d(out)
    r3 = _as_3d(residual) if residual is not None else x3
    rows = x3.shape[0] * x3.shape[1]
    if rows == 0:
        return
    block = next_pow2(x.shape[-1])
    rms_norm_kernel[(rows,)](
        x3, r3, weight, o3, x3.shape[1], x.shape[-1], eps,
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), o3.stride(0), o3.stride(1),
        HAS_RESIDUAL=residual is not None, GEMMA=gemma, BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip


def fused_add_rms_norm(
    x: torch.Tensor,  # [rows, hidden]: the sub-layer's output; receives the normalised rows
    residual: torch.Tensor,  # [rows, hidden]: the residual stream; receives x + residual
    weight: torch.Tensor,  # [hidden]
    eps: float,
    gemma: bool = False,  # scale by (1 + weight) in float32, as Gemma's norms do
) -> tuple[torch.Tensor, torch.Tensor]:  # (x, residual), both updated in place
    """``residual += x; x = RMSNorm(residual)`` in one launch, in place (Triton)."""
    _check_args(x, weight, residual)
    _launch(x, weight, eps, residual, x, gemma)
    return x, residual


def rms_norm(
    x: torch.Tensor,  # [rows, hidden] or [A, B, hidden] (e.g. [tokens, heads, head_dim] for q/k norms)
    weight: torch.Tensor,  # [hidden]
    eps: float,
    gemma: bool = False,
) -> torch.Tensor:  # x's shape, a new contiguous tensor
    """RMSNorm of each row of ``x`` into a new tensor, one launch (Triton)."""
    _check_args(x, weight, None)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, weight, eps, None, out, gemma)
    return out


def fused_add_rms_norm_reference(
    x: torch.Tensor,  # [..., hidden]
    residual: torch.Tensor | None,  # [..., hidden] or None (plain RMSNorm)
    weight: torch.Tensor,  # [hidden]
    eps: float,
    gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normalised, x + residual or x), new tensors
    """Torch ops as the decoder's RMSNorm writes them, out of place."""
    s = x if residual is None else x + residual
    normed = s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (normed * (1.0 + weight.float())).to(s.dtype), s
    return weight * normed.to(s.dtype), s
