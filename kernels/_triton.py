"""Optional Triton import and the checks every launcher shares.

Triton is an optional extra (``pip install 'pagedllm[triton]'``): without it the torch
references still import and run, and the Triton launchers raise a clear error.

NOTE: when Triton is missing, ``triton.jit`` becomes an identity decorator and
``tl.constexpr`` (evaluated in kernel signatures at definition time) an inert
placeholder, so the kernel modules keep their plain ``@triton.jit`` definitions.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised by a subprocess test
    HAS_TRITON = False

    class _MissingTriton:
        """Stands in for ``triton`` / ``triton.language`` at import time only."""

        constexpr = None

        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

        def __getattr__(self, name):
            return None

    triton = _MissingTriton()
    tl = _MissingTriton()

__all__ = [
    "HAS_TRITON",
    "triton",
    "tl",
    "check_can_launch",
    "next_pow2",
    "runs_on_triton",
    "soft_cap_log2",
    "NO_WINDOW",
]

NO_WINDOW = 2**31 - 1
"""The window the kernels get when there is none: every position is inside it (int32, no overflow)."""


@triton.jit
def soft_cap_log2(scores, scale, cap):
    """``cap * tanh(scores * scale / cap)`` in the log2 domain (times log2(e)).

    NOTE: tanh(x) = 1 - 2 / (exp(2x) + 1) saturates cleanly: exp2 overflows to inf for
    large x (giving 1) and underflows to 0 for very negative x (giving -1).
    """
    x = scores * (scale / cap)
    tanh = 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)
    return tanh * (cap * 1.4426950408889634)  # log2(e)


def check_can_launch(kernel, *tensors: torch.Tensor) -> None:
    """Raise a ``RuntimeError`` a user can act on when ``kernel`` cannot run here."""
    if not HAS_TRITON:
        raise RuntimeError(
            "Triton is not installed: install it with `pip install 'pagedllm[triton]'`, "
            "or use the torch reference (attention_backend='torch')"
        )
    interpreted = type(kernel).__name__ == "InterpretedFunction"
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {t.device} and {device}")
    if device.type != "cuda" and not interpreted:
        raise RuntimeError(
            f"Triton kernels need CUDA tensors, got tensors on {device}; set "
            "TRITON_INTERPRET=1 before importing pagedllm.kernels to run them on CPU "
            "through Triton's interpreter, or use the *_reference functions"
        )
    if interpreted and any(t.dtype == torch.bfloat16 for t in tensors):
        raise TypeError("Triton's CPU interpreter has no bfloat16; use float16 or float32")


def runs_on_triton(t: torch.Tensor) -> bool:
    """Whether the model's layer ops should take their Triton kernels for ``t``: CUDA tensors with
    Triton installed. CPU tensors keep their own kernels, interpreter or not."""
    return HAS_TRITON and t.is_cuda


def is_interpreted(kernel) -> bool:
    """Whether ``kernel`` runs through Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return type(kernel).__name__ == "InterpretedFunction"


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (>= 1): Triton tiles must be powers of two."""
    return 1 << max(0, (int(n) - 1).bit_length())
