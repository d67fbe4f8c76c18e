"""SwiGLU's ``silu(gate) * up`` in one pass compiled for the CPU (Numba).

The torch version is two ops: ``silu(gate)`` written to a new tensor, then ``* up`` read
back from it. Here one loop per token row reads ``gate`` and ``up`` once and writes the
product::

    out[t, i] = silu(gate[t, i]) * up[t, i]        silu(g) = g / (1 + exp(-g))

``gate`` and ``up`` may be column slices of one tensor (the two halves of a fused
gate-up projection, ``gate_up.chunk(2, dim=-1)``): each is read through its own row
stride, without a copy.

Float32 and bfloat16. In bfloat16 the kernel rounds as torch does, after each op: the
SiLU to bfloat16, then the product. ``exp`` is a polynomial that vectorises (Cephes'
``expf``, as in SSE/AVX "mathfun") rather than torch's (SLEEF's): the two differ in the
last bit now and then, so the float32 result is within a few ulp of the reference's (not
bitwise), and a bfloat16 result can differ by one bfloat16 ulp where the float32 SiLU
lies that close to a rounding tie. Infinities and NaN come out as torch's.

Rows are spread over the threads from [48, 1376] up (_numba_cpu.launch). Median µs of the
compiled kernel alone on [rows, 1376], one thread / two::

    rows    float32         bfloat16
      16     8.9 /   6.1    14.3 /   8.9
      64    36.2 /  20.2    55.7 /  30.0
     512   275.2 / 139.8   446.9 / 227.5

Called from torch, the launcher adds about 7 µs (tensor-to-array views, checks, the output),
so at decode sizes it is no faster than torch's two ops (benchmarks/cpu_ops.py, [16, 1376],
2 threads: 16.4 µs against 12.7 in float32, 22.8 against 18.0 in bfloat16); from prefill
sizes on it is ([512, 1376]: 154 against 181, 242 against 260), and it spares the
temporary. It pays most behind a fused gate-up projection, whose halves it reads in place.
Below ``KERNEL_MIN_ELEMENTS`` (decode batches) :func:`silu_and_mul_cpu` calls torch's ops.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ._fast_exp import exp
from ._numba_cpu import KERNEL_DTYPES, compile_kernel, flat_rows, kernel_array, launch
from .paged_decode_attention_cpu import HAS_NUMBA

if HAS_NUMBA:
    import numba

    from ._numba_cpu import load, round_like, store_like


def silu_and_mul_reference(
    gate: torch.Tensor,  # [tokens, inner]
    up: torch.Tensor,  # [tokens, inner]
) -> torch.Tensor:  # [tokens, inner], a new tensor
    """``silu(gate) * up`` in torch ops."""
    # NOTE: the product is taken in place in silu's output, a tensor of this call's own.
    return torch.nn.functional.silu(gate).mul_(up)


def _kernel(gate, gate_stride, up, up_stride, out):  # pragma: no cover - compiled
    # gate, up: flat, row t at t * stride; out: [tokens, inner]
    tokens, inner = out.shape
    for t in numba.prange(tokens):
        # NOTE: row slices, indexed from 0 by the loop: indices known non-negative vectorise
        gate_row = gate[t * gate_stride : t * gate_stride + inner]
        up_row = up[t * up_stride : t * up_stride + inner]
        for i in range(inner):
            g = load(gate_row[i])
            act = round_like(g / (np.float32(1.0) + exp(-g)), out)
            out[t, i] = store_like(act * load(up_row[i]), out)


@functools.cache
def _compiled(parallel: bool):
    return compile_kernel(_kernel, parallel, fastmath=_FASTMATH)


# NOTE: contraction into fused multiply-adds only, which reaches only exp's polynomial (a
# quarter faster): each of the kernel's own ops is one operation rounded as torch's.
_FASTMATH = {"contract"}


# NOTE: below this many elements torch's two ops are faster than the kernel called from torch:
# its launcher's fixed cost (the arrays, the output, the checks, about 5 µs) outweighs the
# pass it saves. Median µs per call, one thread, bfloat16, torch's two ops against the kernel
# (in-process A/B, shared 2-core machine; ratios hold better than the absolute numbers)::
#
#     [rows, inner]    [1, 4864]    [4, 4864]    [16, 4864]    [32, 4864]    [32, 1376]
#     torch / kernel   4.1 / 8.6   10.9 / 16.1   37.0 / 37.8   71.9 / 67.1   23.6 / 24.9
#
# (float32 crosses at the same sizes.) Decode batches therefore take torch's ops; prefill
# chunks, and batches from about 16 rows of a 0.5B model's MLP, the kernel.
KERNEL_MIN_ELEMENTS = 1 << 16


def silu_and_mul_cpu(
    gate: torch.Tensor,  # [tokens, inner], columns contiguous, rows at any stride
    up: torch.Tensor,  # [tokens, inner], gate's dtype
) -> torch.Tensor:  # [tokens, inner], a new contiguous tensor
    """:func:`silu_and_mul_reference` in one compiled pass for float32 or bfloat16 CPU
    tensors of at least ``KERNEL_MIN_ELEMENTS``; the reference otherwise."""
    if not HAS_NUMBA or gate.dtype not in KERNEL_DTYPES or up.dtype != gate.dtype or gate.dim() != 2:
        return silu_and_mul_reference(gate, up)
    if gate.shape != up.shape or gate.device.type != "cpu" or up.device.type != "cpu" or gate.numel() == 0:
        return silu_and_mul_reference(gate, up)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return silu_and_mul_reference(gate, up)
    if gate.numel() < KERNEL_MIN_ELEMENTS:
        return silu_and_mul_reference(gate, up).contiguous()
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    (gate_flat, gate_stride), (up_flat, up_stride) = flat_rows(gate), flat_rows(up)
    launch(_compiled, out.numel())(gate_flat, gate_stride, up_flat, up_stride, kernel_array(out))
    return out
