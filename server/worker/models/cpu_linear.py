"""Linear layers on the CPU: GEMMs on weights reordered once, after loading.

``F.linear`` on the CPU hands its plain ``[out, in]`` weight to the BLAS on every call,
which re-blocks it each time. oneDNN can instead keep the weight in the blocked layout its
GEMM reads (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's weight freezing
uses) and run the product on it directly (``torch.ops.mkldnn._linear_pointwise``)::

    load:  weight [out, in] (plain) ──reorder once──► weight [out, in] (mkldnn layout)
    step:  linear(x, weight, bias)  ──► oneDNN GEMM on the blocked weight (no per-call reorder)

On a CPU with AVX-512-BF16, a bfloat16 weight is packed for the engine's own kernel
instead (kernels/bf16_gemm_cpu.py): it streams the weight while it multiplies, as oneDNN does
at 1-4 rows but not at the 8-16 rows of a batch's decode step, and matches oneDNN on prefill
chunks. Its packed tensor is a plain one marked with :data:`TILED` (``[out, in]`` in shape only).
On a CPU with AVX2 only the same layout runs the kernel's AVX2 variant: oneDNN has no
bfloat16 GEMM there, and without either a bfloat16 weight stays plain (:func:`can_pack`).
There a float32 weight is packed for the same module's float32 kernel too, which ran the
float32 projections 1.2-2.5x faster than oneDNN at decode sizes (:func:`takes_tiles`).

The packed tensor replaces the parameter (same name, shape and dtype; its memory is the
blocked copy only), so a weight is never held twice. :func:`linear` is the one call every
projection makes: it runs oneDNN on a packed weight and ``F.linear`` on a plain one
(CUDA, float16, a weight that is also an embedding table, or a torch without oneDNN).

NOTE: a packed weight can only be multiplied: it cannot be indexed, copied into or
loaded again. Packing therefore happens last, after the checkpoint is in
(:func:`prepack_linears`), and only for layers that use their weight through
:func:`linear` alone (:class:`PackableLinear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import bf16_gemm_cpu

PACKED_DTYPES = (torch.float32, torch.bfloat16)
"""Weight dtypes oneDNN runs from the blocked layout on x86 CPUs (bfloat16 fast with AVX-512-BF16 or AMX)."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with ``weight`` plain or packed by :func:`pack_weight`.

    x: [..., in]; weight: [out, in]; bias: [out] or None -> [..., out]
    """
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if getattr(weight, TILED, False):
        return bf16_gemm_cpu.gemm(x, weight, bias)
    return F.linear(x, weight, bias)


TILED = "bf16_tiles"
"""The attribute that marks a weight packed for kernels/bf16_gemm_cpu.py."""


def is_packed(weight: torch.Tensor) -> bool:
    """Whether ``weight`` was packed by :func:`pack_weight` (either layout): it can only be multiplied."""
    return weight.is_mkldnn or getattr(weight, TILED, False)


def packed_kernel(weight: torch.Tensor) -> str:
    """Which GEMM multiplies ``weight``: ``bf16-tiles``, ``f32-tiles``, ``onednn-packed`` or ``torch-linear``."""
    if getattr(weight, TILED, False):
        return "f32-tiles" if weight.dtype == torch.float32 else "bf16-tiles"
    return "onednn-packed" if weight.is_mkldnn else "torch-linear"


def can_pack(weight: torch.Tensor) -> bool:
    """Whether :func:`pack_weight` applies: a plain 2-D CPU weight of :data:`PACKED_DTYPES`, with oneDNN present
    and, for bfloat16, a CPU that runs one of the bfloat16 GEMMs (:func:`bf16_packable`)."""
    return (
        torch.backends.mkldnn.is_available()
        and weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and weight.dim() == 2
        and not is_packed(weight)
        and (weight.dtype != torch.bfloat16 or bf16_packable(weight))
    )


def bf16_packable(weight: torch.Tensor) -> bool:
    """Whether a bfloat16 ``weight`` has a packed GEMM here: the C kernel's tiles, or oneDNN's
    bfloat16 path, which needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT. On a CPU with AVX2
    only, oneDNN refuses to reorder a bfloat16 weight, and the weight stays plain (``F.linear``)."""
    return takes_tiles(weight) or onednn_bf16()


def takes_tiles(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is packed for kernels/bf16_gemm_cpu.py: bfloat16 of its shape on a CPU the
    bfloat16 kernel runs on, or float32 of its shape on a CPU with AVX2 and no AVX-512."""
    if weight.dtype == torch.float32:
        return bf16_gemm_cpu.can_pack_f32(weight) and bf16_gemm_cpu.f32_available()
    return bf16_gemm_cpu.can_pack(weight) and bf16_gemm_cpu.available()


def onednn_bf16() -> bool:
    """Whether oneDNN runs bfloat16 GEMMs on this CPU (and so reorders bfloat16 weights)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> nn.Parameter:
    """``weight`` [out, in] reordered for the fastest GEMM here, as a frozen parameter: for
    kernels/bf16_gemm_cpu.py where it runs (bfloat16; AVX-512-BF16 or AVX2), else oneDNN's blocked layout.

    NOTE: no batch size is given: the layout must serve decode steps of any batch and
    prefill chunks alike (measured: as fast as a layout packed for the batch at hand, within
    5% at 1-16 rows on Qwen2.5-0.5B's shapes: ``python -m benchmarks.cpu_linear --variants``).
    """
    if takes_tiles(weight):
        pack = bf16_gemm_cpu.pack_f32 if weight.dtype == torch.float32 else bf16_gemm_cpu.pack
        tiled = nn.Parameter(pack(weight), requires_grad=False)
        setattr(tiled, TILED, True)
        return tiled
    return nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None), requires_grad=False)


class PackableLinear(nn.Module):
    """A layer whose ``weight`` [out, in] is used through :func:`linear` only, so it may be packed."""

    weight: torch.Tensor

    def packable(self) -> bool:
        """Whether this layer's weight may be packed (not when another layer reads it too)."""
        return True


def prepack_linears(model: nn.Module) -> int:
    """Pack the weight of every :class:`PackableLinear` in ``model`` that :func:`can_pack`, in place.

    Call once, after the weights are loaded. Returns how many weights were packed.
    """
    packed = 0
    for module in model.modules():
        if isinstance(module, PackableLinear) and module.packable() and can_pack(module.weight):
            with torch.no_grad():
                weight = pack_weight(module.weight)
            # NOTE: what loading marked on the plain parameter (its TP shard rule, read by LoRA) stays
            if hasattr(module.weight, "shard"):
                weight.shard = module.weight.shard  # type: ignore[attr-defined]
            module.weight = weight
            packed += 1
    return packed
