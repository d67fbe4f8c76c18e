"""Gated MLP activation ``act(gate) * up`` in one pass for CUDA (Triton): SiLU (SwiGLU) or
GELU, exact or tanh-approximated (GeGLU, Gemma's ``gelu_pytorch_tanh``).

torch runs two kernels and a temporary (the activation, then the product); here one reads
``gate`` and ``up`` once and writes the product. ``gate`` and ``up`` may be the two column
halves of a fused gate-up projection's output (rows at any stride); the result is a new
contiguous tensor. As torch does, the activation is rounded to the activations' dtype
before the product.
"""

from __future__ import annotations

import torch

from ._triton import check_can_launch, next_pow2, tl, triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


@triton.jit
def _sigmoid(x):
    # NOTE: exp of a non-positive argument only, so nothing overflows at large |x|
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def act_and_mul_kernel(
    gate_ptr,  # [tokens, inner]
    up_ptr,  # [tokens, inner]
    out_ptr,  # [tokens, inner]
    inner,
    stride_gate,
    stride_up,
    stride_out,
    ACT: tl.constexpr,  # 0 silu, 1 gelu (erf), 2 gelu (tanh)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    g = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0)
    u = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0)
    x = g.to(tl.float32)
    if ACT == 0:
        a = x * _sigmoid(x)
    elif ACT == 1:
        a = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    else:
        y = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        a = 0.5 * x * (1.0 + (2.0 * _sigmoid(2.0 * y) - 1.0))  # tanh(y) = 2 sigmoid(2y) - 1
    out = a.to(g.dtype).to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(
    gate: torch.Tensor,  # [tokens, inner], columns contiguous, rows at any stride
    up: torch.Tensor,  # [tokens, inner], gate's dtype
    activation: str = "silu",  # one of ACTIVATIONS
) -> torch.Tensor:  # [tokens, inner], a new contiguous tensor
    """``act(gate) * up`` in one launch (Triton)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if gate.dim() != 2 or gate.shape != up.shape or gate.dtype not in _FLOAT_DTYPES or up.dtype != gate.dtype:
        raise ValueError(f"gate and up must be [tokens, inner] of one float dtype, got {gate.dtype} "
                         f"{tuple(gate.shape)} and {up.dtype} {tuple(up.shape)}")  # fmt: skip
    for name, t in (("gate", gate), ("up", up)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    check_can_launch(act_and_mul_kernel, gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    block = min(1024, next_pow2(gate.shape[1]))
    grid = (gate.shape[0], triton.cdiv(gate.shape[1], block))
    act_and_mul_kernel[grid](
        gate, up, out, gate.shape[1], gate.stride(0), up.stride(0), out.stride(0),
        ACT=ACTIVATIONS.index(activation), BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one launch (Triton); see :func:`act_and_mul`."""
    return act_and_mul(gate, up, "silu")


def act_and_mul_reference(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` in torch ops."""
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    return torch.nn.functional.gelu(gate, approximate=approximate) * up
