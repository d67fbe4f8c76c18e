"""RMSNorm, optionally after a residual add, in one pass compiled for the CPU (Numba).

LLaMA's layer adds the attention output to the residual stream and normalises the sum
before the MLP. In torch ops that is seven passes over the activations (add, pow, mean,
add eps, rsqrt, two muls) with a temporary each; here one loop per token row::

    row t:  s = x[t] + residual[t]      (stored: the new residual stream)
            inv = 1 / sqrt(mean(s * s) + eps)
            out[t] = weight * (s * inv)

Float32 only (NumPy has no bfloat16); other dtypes take :func:`rms_norm_reference`,
which is what the torch path computes. The multiplications are done in the reference's
order and without fast-math, so only the mean's summation order differs from it (a
rounding of the last bit of ``inv``).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .paged_decode_attention_cpu import HAS_NUMBA

if HAS_NUMBA:
    import numba


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
    tokens, hidden = x.shape
    for t in range(tokens):
        acc = np.float32(0.0)
        for i in range(hidden):
            s = x[t, i] + residual[t, i] if residual.shape[0] else x[t, i]
            summed[t, i] = s
            acc += s * s
        inv = np.float32(1.0) / np.sqrt(acc / np.float32(hidden) + eps)
        for i in range(hidden):
            out[t, i] = weight[i] * (summed[t, i] * inv)


@functools.cache
def _compiled():
    try:
        return numba.njit(cache=True, fastmath=_FASTMATH, boundscheck=False)(_kernel)
    except RuntimeError:  # numba: no writable cache directory
        return numba.njit(cache=False, fastmath=_FASTMATH, boundscheck=False)(_kernel)


# NOTE: reassociation only, so the sum of squares vectorises (as torch's does); no
# contraction into fused multiply-adds, so each product rounds as the reference's does.
_FASTMATH = {"reassoc"}


def rms_norm_cpu(
    x: torch.Tensor,  # [tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:  # (normalised, x + residual or x)
    """:func:`rms_norm_reference` in one compiled pass for contiguous float32 CPU tensors; the reference otherwise."""
    plain = [x, weight] + ([residual] if residual is not None else [])
    if not HAS_NUMBA or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in plain) or x.dim() != 2:
        return rms_norm_reference(x, weight, eps, residual)
    if torch.is_grad_enabled() and any(t.requires_grad for t in plain):
        return rms_norm_reference(x, weight, eps, residual)
    x = x.contiguous()
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    none = np.empty((0, 0), np.float32)
    _compiled()(
        x.numpy(),
        residual.contiguous().numpy() if residual is not None else none,
        weight.detach().numpy(),
        np.float32(eps),
        out.numpy(),
        summed.numpy() if residual is not None else np.empty_like(x.numpy()),
    )
    return out, summed
