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

from ._numba_cpu import KERNEL_DTYPES, compile_kernel, dtype_token, launch
from .paged_decode_attention_cpu import HAS_NUMBA

if HAS_NUMBA:
    import numba

    from ._numba_cpu import address_as, load, round_like, store_like


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


def _kernel(x_at, residual_at, weight_at, out_at, summed_at, tokens, hidden, eps, like):  # pragma: no cover
    # *_at: addresses of C-contiguous tensors of like's dtype: x, out, summed [tokens, hidden],
    # weight [hidden]; residual_at 0 where there is none (summed_at is then x_at)
    # NOTE: by address, not as arrays: a tensor's array costs about 1 us, as much as a decode-size call's work
    x = numba.carray(address_as(x_at, like), (tokens, hidden))
    has_residual = residual_at != 0
    residual = numba.carray(address_as(residual_at if has_residual else x_at, like), (tokens, hidden))
    weight = numba.carray(address_as(weight_at, like), (hidden,))
    out = numba.carray(address_as(out_at, like), (tokens, hidden))
    summed = numba.carray(address_as(summed_at, like), (tokens, hidden))
    for t in numba.prange(tokens):
        acc = np.float32(0.0)
        for i in range(hidden):
            if has_residual:
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
    if weight.shape != x.shape[1:] or (residual is not None and residual.shape != x.shape):
        return rms_norm_reference(x, weight, eps, residual)
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    if residual is None:
        summed, residual_at = x, 0
    else:
        summed, residual = torch.empty_like(x), residual.contiguous()
        residual_at = residual.data_ptr()
    tokens, hidden = x.shape
    launch(_compiled, tokens * hidden)(
        x.data_ptr(), residual_at, weight.data_ptr(), out.data_ptr(), summed.data_ptr(), tokens, hidden,
        np.float32(eps), dtype_token(dtype),
    )  # fmt: skip
    return out, summed
