"""The oracles of kernels/w4_gemm_cpu.py: the 4-bit weight-only product in float64 on the dequantized
weight, with x as given (:func:`w4_gemm_reference`) or rounded to int8 as ``gemm_int8`` rounds it
(:func:`w4a8_reference`)."""

from __future__ import annotations

import torch

__all__ = ["w4_gemm_reference", "w4a8_reference"]


def w4_gemm_reference(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """The oracle: ``x @ W.T`` on the dequantized weight ``W = scale * (q - zero)`` in float64, rounded to
    bfloat16 once. q: [n, k]; scales, zeros: [n, k / group]."""
    w = (q.double() - zeros.double().repeat_interleave(group, 1)) * scales.double().repeat_interleave(group, 1)
    return (x.double() @ w.T).to(torch.bfloat16)


def w4a8_reference(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """The oracle of :func:`gemm_int8`: x rounded as the kernel rounds it (per row and group, scale
    max |x| / 127 in float32, levels x * (127 / max) rounded to nearest even), then
    :func:`w4_gemm_reference` on the dequantized x."""
    rows = x.float().reshape(-1, x.shape[-1])
    m, k = rows.shape
    grouped = rows.view(m, k // group, group)
    top = grouped.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros_like(top))
    levels = torch.round(grouped * inverse)
    dequantized = (levels.double() * (top / 127.0).double()).view(m, k)
    out = w4_gemm_reference(dequantized, q, scales, zeros, group)
    return out.view(*x.shape[:-1], out.shape[-1])
