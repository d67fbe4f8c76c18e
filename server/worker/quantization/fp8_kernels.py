"""The CUDA matmuls of fp8 weights (compressed-tensors FP8 W8A8, block-wise ``fp8``, ``--quantization fp8``).

    kernel            when                                               activations
    fp8-scaled-mm     sm89+, one scale per output channel, N, K % 16 == 0  e4m3 per token (W8A8)
    fp8-triton        any other CUDA device, or block-wise scales          their own dtype (W8A16)

Both run :mod:`pagedllm.kernels.fp8_matmul`; the choice is made once per layer at load, from
the device's compute capability (:func:`cuda_capability`), the weight's scale layout and one
16 x 16 probe of ``_scaled_mm`` with row and column scales (:func:`rowwise_scaled_mm_runs`):
torch builds have run those scales on sm90 only, or not on some newer parts, and raise there.

A :class:`~pagedllm.server.worker.quantization.base.QuantizedWeight` keeps block-wise scales
repeated along N (``[N, K / bk]``: fused q/k/v or gate/up parts need not end on a block
boundary), so the Triton kernel reads them as blocks of one row by ``bk`` columns. That costs
``4 / bk`` bytes a weight (3% of fp8's byte at bk = 128).

NOTE: ``fp8-scaled-mm`` quantizes each token's activations to e4m3 as it runs, as the W8A8
formats define and as vLLM runs them; ``fp8-triton`` and the CPU reference multiply the
activations as they are, so the two differ by that rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.server.worker.quantization.base import QuantizedWeight

SCALED_MM_CAPABILITY = (8, 9)
"""The first compute capability with fp8 tensor cores (Ada; Hopper is 9.0)."""


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """``device``'s compute capability (a seam the tests replace to pick kernels without a GPU)."""
    return torch.cuda.get_device_capability(device)


def rowwise_scaled_mm_runs(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs e4m3 x e4m3 with a scale per row of A and per column of B on ``device``."""
    try:
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        scale = torch.ones(16, 1, device=device)
        torch._scaled_mm(a, a.t(), scale_a=scale, scale_b=scale.t().contiguous(), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _per_channel(w: QuantizedWeight) -> bool:
    return w.zeros is None and w.group_size == w.shape[1] and tuple(w.scales.shape) == (w.shape[0], 1)


class Fp8ScaledMmKernel(nn.Module):
    """``torch._scaled_mm`` on fp8 tensor cores: the weight as loaded, the activations e4m3 per token."""

    name = "fp8-scaled-mm"
    q: torch.Tensor
    scales: torch.Tensor

    def __init__(self, w: QuantizedWeight) -> None:
        super().__init__()
        self.register_buffer("q", w.q.contiguous())  # [N, K] float8_e4m3fn
        self.register_buffer("scales", w.scales[:, 0].float().contiguous())  # [N]

    @staticmethod
    def fits(w: QuantizedWeight, capability: tuple[int, int]) -> bool:
        n, k = w.shape
        fp8 = w.q.dtype == torch.float8_e4m3fn and hasattr(torch, "_scaled_mm")
        return fp8 and capability >= SCALED_MM_CAPABILITY and _per_channel(w) and n % 16 == 0 and k % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pagedllm.kernels.fp8_matmul import fp8_scaled_mm

        return fp8_scaled_mm(x, self.q, self.scales)


class Fp8TritonKernel(nn.Module):
    """The Triton W8A16 GEMM that decodes the fp8 bytes tile by tile (any GPU; block-wise scales)."""

    name = "fp8-triton"
    q: torch.Tensor
    scales: torch.Tensor

    def __init__(self, w: QuantizedWeight) -> None:
        super().__init__()
        self.register_buffer("q", w.q.contiguous())  # [N, K] float8_e4m3fn
        if _per_channel(w):
            self.block: tuple[int, int] | None = None
            self.register_buffer("scales", w.scales[:, 0].float().contiguous())  # [N]
        else:
            self.block = (1, w.group_size)
            self.register_buffer("scales", w.scales.float().contiguous())  # [N, K / group]

    @staticmethod
    def fits(w: QuantizedWeight) -> bool:
        n, k = w.shape
        if w.q.dtype != torch.float8_e4m3fn or w.zeros is not None or w.perm is not None:
            return False
        return _per_channel(w) or (w.group_size % 16 == 0 and k % w.group_size == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pagedllm.kernels.fp8_matmul import fp8_matmul_triton

        return fp8_matmul_triton(x, self.q, self.scales, self.block)


def choose_fp8_kernel(w: QuantizedWeight, device: torch.device) -> nn.Module | None:
    """The CUDA kernel for an fp8 weight on ``device``, or None where neither takes it."""
    if Fp8ScaledMmKernel.fits(w, cuda_capability(device)) and rowwise_scaled_mm_runs(device):
        return Fp8ScaledMmKernel(w)
    if Fp8TritonKernel.fits(w):
        return Fp8TritonKernel(w)
    return None
