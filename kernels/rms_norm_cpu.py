"""RMSNorm, optionally after a residual add, in one pass compiled for the CPU (Numba).

LLaMA's layer adds the attention output to the residual stream and normalises the sum
before the MLP. In torch ops that is seven passes over the activations (add, pow, mean,
add eps, rsqrt, two muls) with a temporary each; here one loop per token row::

    row t:  s = x[t] + residual[t]      (stored: the new residual stream)
            inv = 1 / sqrt(mean(s * s) + eps)
            out[t] = weight * (s * inv)

Float32 and bfloat16 (as bit patterns, see _numba_cpu.py); other dtypes take
:func:`rms_norm_reference`, which is what the torch path computes. In bfloat16 the kernel
rounds where the reference's ops do: the sum ``x + residual`` (the new residual stream),
the normalised row (computed in float32, then rounded), and the product with the weight.
The multiplications are done in the reference's order and without fast-math, so only the
mean's summation order differs from it: a rounding of the last bit of ``inv``, which
shows in float32 and, in bfloat16, only where a normalised value lies that close to a
rounding tie.

Rows are spread over the threads from [128, 512] up (_numba_cpu.launch). Median µs of the
compiled kernel alone, residual add + RMSNorm on [rows, 512], one thread / two::

    rows    float32        bfloat16
      16    2.2 /  2.7     4.4 /  3.9
      64    7.0 /  5.2    15.8 /  9.6
     512   54.0 / 29.4   121.9 / 63.8
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ._numba_cpu import KERNEL_DTYPES, compile_kernel, kernel_array, launch
from .paged_decode_attention_cpu import HAS_NUMBA

if HAS_NUMBA:
    import numba

    from ._numba_cpu import load, round_like, store_like


def rms_norm_reference(
    x: torch.Tensor,  # [tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [tokens, hidden]: added to x first
) -> tuple[torch.Tensor, torch.Tensor]:  # (normalised [tokens, hidden], x + residual or x)
    """``weight * (s * rsqrt(mean(s^2) + eps))`` with ``s = x + residual``, computed in float32 and cast first."""
    s = x if residual is None else x + residual
    dtype = s.dtype
    normed = s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(dtype), s


def _kernel(x, residual, weight, eps, out, summed):  # pragma: no cover - compiled
    # x, out: [tokens, hidden]; residual, summed: [tokens, hidden], or [0, 0] and x; weight: [hidden]
    tokens, hidden = x.shape
    for t in numba.prange(tokens):
        acc = np.float32(0.0)
        for i in range(hidden):
            if residual.shape[0]:
                s = round_like(load(x[t, i]) + load(residual[t, i]), x)
                summed[t, i] = store_like(s, x)
            else:
                s = load(x[t, i])
            acc += s * s
        inv = np.float32(1.0) / np.sqrt(acc / np.float32(hidden) + eps)
        for i in range(hidden):
            normed = round_like(load(summed[t, i]) * inv, x)
            out[t, i] = store_like(load(weight[i]) * normed, x)


@functools.cache
def _compiled(parallel: bool):
    return compile_kernel(_kernel, parallel, fastmath=_FASTMATH)


# NOTE: reassociation only, so the sum of squares vectorises (as torch's does); no
# contraction into fused multiply-adds, so each product rounds as the reference's does.
_FASTMATH = {"reassoc"}


def rms_norm_cpu(
    x: torch.Tensor,  # [tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:  # (normalised, x + residual or x)
    """:func:`rms_norm_reference` in one compiled pass for float32 or bfloat16 CPU tensors of
    one dtype; the reference otherwise."""
    # NOTE: a decode step calls this twice per layer on a row or a few, where the kernel takes
    # well under a microsecond: the checks and conversions below are most of a call, so they
    # are written out rather than looped over a list of the tensors.
    dtype = x.dtype
    if not HAS_NUMBA or dtype not in KERNEL_DTYPES or x.dim() != 2 or not (x.is_cpu and weight.is_cpu):
        return rms_norm_reference(x, weight, eps, residual)
    if weight.dtype != dtype or (residual is not None and (residual.dtype != dtype or not residual.is_cpu)):
        return rms_norm_reference(x, weight, eps, residual)
    grad = x.requires_grad or weight.requires_grad or (residual is not None and residual.requires_grad)
    if grad and torch.is_grad_enabled():
        return rms_norm_reference(x, weight, eps, residual)
    x = x.contiguous()
    out = torch.empty_like(x)
    xs = kernel_array(x)
    if residual is None:
        summed, summed_array, residual_array = x, xs, _NO_RESIDUAL[xs.dtype]
    else:
        summed = torch.empty_like(x)
        summed_array, residual_array = kernel_array(summed), kernel_array(residual.contiguous())
    weights = kernel_array(weight.detach() if weight.requires_grad else weight)
    launch(_compiled, x.numel())(xs, residual_array, weights, np.float32(eps), kernel_array(out), summed_array)
    return out, summed


# The kernel's ``residual`` where there is none, by x's array dtype.
_NO_RESIDUAL = {np.dtype(np.float32): np.empty((0, 0), np.float32), np.dtype(np.uint16): np.empty((0, 0), np.uint16)}
