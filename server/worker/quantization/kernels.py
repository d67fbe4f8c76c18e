"""The matmuls a quantized layer runs, chosen once per layer from its :class:`QuantizedWeight`.

    kernel        device  weights kept as                           when
    w4a16-tiles   CPU     4-bit pairs [N/16, K/2, 16] + float32      as int4-cpu, bfloat16 activations, an
                          (scale, 128 + zero) per group             AVX-512-BF16 CPU (w4a16_cpu.py); labelled
                                                                    w4a8-tiles where it rounds x to int8
                                                                    (VNNI and VBMI too, groups of 16k)
    w8a8-tiles    CPU     8-bit quads [N/16, K/4, 64] + float32      8-bit, bfloat16 activations rounded to
                          (scale, 128 + zero) per group             int8 per group, VNNI and VBMI (w4a16_cpu.py)
    int4-cpu      CPU     oneDNN-free packed int4 [N, K / 2] + (scale, zero) per group   4-bit, group 32..256
    int8-cpu      CPU     int8 [N, K] + one scale per channel        8-bit symmetric per channel
    int8-w8a8-cpu CPU     int8 [N, K]; activations int8 per token    compressed-tensors int8 W8A8 (int32 GEMM)
    w4a16-triton  CUDA    int32 [K * bits / 32, N] packed along K    4- and 8-bit unsigned ints with zeros
    fp8-scaled-mm CUDA    float8 [N, K] + one scale per channel      sm89+ (fp8_kernels.py)
    fp8-triton    CUDA    float8 [N, K] + channel or block scales    other GPUs, block-wise scales
    dequantize    any     the integer / fp8 levels as loaded         everything else (the reference)

``python -m benchmarks.quant_linear`` measures them at a real model's sizes (Qwen2.5-0.5B's
projections, 1..64 rows of bfloat16, 1 and 2 threads): the packed int4 matmul reads a quarter of
the bytes of bfloat16 and wins at decode sizes, but its cost grows with every row; from
``dense_rows`` rows (:data:`DENSE_ROWS_BFLOAT16`; always in float32) ``int4-cpu`` widens the
packed weight a tile at a time (``pagedllm.kernels.int4_unpack_cpu``) and runs oneDNN's GEMM.
With bfloat16 activations on an AVX-512-BF16 or AVX2 CPU ``w4a16-tiles`` runs instead, at every row count
(faster than both at 1 to 256 rows in one comparison, w4a16_cpu.py); ``int4-cpu`` stays for float32
activations and where ``w4a16-tiles`` cannot run.

The torch int4 CPU matmul computes ``(q - 8) * scale + zero_f`` per group, so a zero level
``z`` becomes the float offset ``zero_f = (8 - z) * scale`` (exact in float32; rounded once to
the activation dtype in bfloat16, like the scale itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.int4_unpack_cpu import int4_unpack_cpu, torch_block, unpack_levels
from pagedllm.server.worker.models.cpu_linear import onednn_bf16
from pagedllm.server.worker.quantization.base import QuantizedWeight, pack_int32
from pagedllm.server.worker.quantization.fp8_kernels import choose_fp8_kernel
from pagedllm.server.worker.quantization.w4a16_cpu import W4A16TilesKernel, W8A8TilesKernel

INT4_CPU_GROUPS = (32, 64, 128, 256)
TILE_ELEMENTS = 1 << 21
"""Weights widened per tile of :meth:`Int4CpuKernel.unpacked_mm` (4 MiB of bfloat16: no fresh pages per call,
and the GEMM reads the tile back from the cache). Qwen2.5-0.5B's gate/up at 64 rows, quiet 2-core machine,
1 / 2 threads: 4.0 / 2.7 ms in 4 MiB tiles, 9.0 / 7.6 in one 17 MiB tile (fresh pages each call), packed
matmul 6.5 / 3.4. NOTE: each tile's GEMM is a parallel region that waits for its slowest thread; where
other processes hold the cores (load average ~3 on 2 cores), 5 tiles took 80 ms against one tile's 8.5."""
DENSE_ROWS_FLOAT32 = 1
"""Rows from which a float32 call unpacks the int4 weight and runs a dense GEMM: always, since torch's packed
int4 matmul has no fast float32 path (measured on a 2-core AVX-512-BF16 EPYC, Qwen2.5-0.5B's 4864 x 896
projection: 15-23 ms per row, linear in rows)."""
DENSE_ROWS_BFLOAT16 = 64
"""Rows from which a bfloat16 call does the same. The packed matmul's cost grows with every row (it widens
each weight again per block of 4 rows and multiplies in float32), the unpacked weight's GEMM hardly does:
per Qwen2.5-0.5B layer (the four projections), in-process A/B (``benchmarks/quant_linear.py``, a shared
2-core AVX-512-BF16 EPYC, quiet), they are about even at 32 rows and the widened weight wins at 64:
11.1 -> 6.6 ms on 1 thread, 5.7 -> 4.5 on 2 (bf16 weights: 4.7 and 2.4). Only where oneDNN runs bfloat16
GEMMs: on an AVX2-only CPU torch's bfloat16 ``mm`` is ~50x slower than the packed matmul (gate/up at 64 rows,
2 threads, Zen 3: 1030 against 21 ms), so there a bfloat16 call never unpacks."""


class DequantizeKernel(nn.Module):
    """The reference on every device: dequantize the weight in float32 per call, then one GEMM."""

    name = "dequantize"
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None

    def __init__(self, w: QuantizedWeight) -> None:
        super().__init__()
        self.register_buffer("q", w.q)
        self.register_buffer("scales", w.scales)
        self.register_buffer("zeros", w.zeros)
        self.group_size, self.bits = w.group_size, w.bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zeros is None and self.group_size == self.q.shape[1]:
            # NOTE: one scale per output channel (fp8 / int8): scale the product, not the weight
            return F.linear(x, self.q.to(x.dtype)) * self.scales[:, 0].to(x.dtype)
        w = QuantizedWeight(self.q, self.scales, self.zeros, self.group_size, self.bits)
        return F.linear(x, w.dequantize(x.dtype))


class Int4CpuKernel(nn.Module):
    """torch's CPU int4 weight-only matmul on the weight packed once ([N, K / 2] uint8).

    NOTE: in float32 that matmul has no fast path (it falls far behind a dense GEMM, more so
    with every row); there the weight is unpacked from the same bytes into float32 for the call
    (:meth:`dense`). torch lays the packed
    weight out in blocks of B output rows (64 on a CPU with AVX-512, 32 with AVX2): byte
    ``k * B/2 + i`` of block b holds row ``Bb + i`` in its low and row ``Bb + B/2 + i`` in its
    high nibble; checked at load.
    """

    name = "int4-cpu"
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        group = w.group_size
        scales, zeros = w.scales, w.zeros
        if group not in INT4_CPU_GROUPS:  # NOTE: one group per channel: the same scale repeated per 128 inputs
            repeat = w.shape[1] // 128
            scales, zeros, group = scales.repeat_interleave(repeat, 1), zeros.repeat_interleave(repeat, 1), 128  # type: ignore[union-attr]
        assert zeros is not None
        self.group_size, self.dims = group, w.shape
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 1)
        self.register_buffer("packed", packed)
        offsets = (8.0 - zeros) * scales
        # scales_and_zeros: [K / group, N, 2] in the activation dtype
        self.register_buffer("scales_and_zeros", torch.stack([scales.T, offsets.T], dim=-1).to(dtype).contiguous())
        bf16_rows = DENSE_ROWS_BFLOAT16 if onednn_bf16() else None
        dense_rows = {torch.float32: DENSE_ROWS_FLOAT32, torch.bfloat16: bf16_rows}.get(dtype)
        self.dense_rows = dense_rows if dense_rows is not None and self._unpacks(w.q) else None
        """From how many rows a call unpacks the weight and runs a dense GEMM (None: never)."""
        self.label = self._label(str(dtype).removeprefix("torch."))
        """What runs the product, for the banner and metrics: the packed matmul and/or the unpacked weight's GEMM."""

    def _label(self, dtype: str) -> str:
        if self.dense_rows is None:
            return self.name
        if self.dense_rows == 1:
            return f"{self.name}-unpacked-{dtype}"
        return f"{self.name}+unpacked-{dtype}-from-{self.dense_rows}-rows"

    @staticmethod
    def fits(w: QuantizedWeight) -> bool:
        n, k = w.shape
        groups_ok = w.group_size in INT4_CPU_GROUPS or (w.group_size == k and k % 128 == 0)
        return w.bits == 4 and w.q.dtype == torch.uint8 and w.zeros is not None and groups_ok and n % 16 == 0

    def _unpacks(self, q: torch.Tensor) -> bool:
        block = torch_block()
        return bool(block) and q.shape[0] % block == 0 and torch.equal(self.unpack(), q)

    def unpack(self) -> torch.Tensor:
        """The levels [N, K] (uint8) back out of the packed bytes."""
        return unpack_levels(self.packed, torch_block())

    def unpacked_mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` [rows, N] through dense GEMMs: the weight widened to ``x``'s dtype (``(q - 8) * scale +
        zero_f`` in float32, rounded once) a tile of columns at a time (:data:`TILE_ELEMENTS`), into one
        buffer reused for every tile."""
        n, k = self.dims
        width = min(n, max(64, TILE_ELEMENTS // k // 64 * 64))
        tile = torch.empty(k, width, dtype=x.dtype)
        parts = []
        for first in range(0, n, width):
            cols = tile if first + width <= n else tile[:, : n - first].contiguous()
            int4_unpack_cpu(self.packed, self.scales_and_zeros, self.group_size, cols, first)
            parts.append(torch.mm(x, cols))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` [rows, N] by torch's packed int4 matmul, the weight never widened."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, K] -> [rows, N]
        if self.dense_rows is not None and x.shape[0] >= self.dense_rows:
            return self.unpacked_mm(x)
        return self.packed_mm(x)


class Int8CpuKernel(nn.Module):
    """torch's CPU int8 weight-only matmul: int8 [N, K] and one scale per output channel."""

    name = "int8-cpu"
    q: torch.Tensor
    scales: torch.Tensor

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        q = w.q if w.zeros is None else (w.q.to(torch.int16) - 128).to(torch.int8)
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scales", w.scales[:, 0].to(dtype).contiguous())

    @staticmethod
    def fits(w: QuantizedWeight) -> bool:
        if w.bits != 8 or w.group_size != w.shape[1]:
            return False
        if w.q.dtype == torch.int8 and w.zeros is None:
            return True
        return w.q.dtype == torch.uint8 and w.zeros is not None and bool((w.zeros == 128).all())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.q, self.scales)


class Int8W8A8CpuKernel(nn.Module):
    """int8 W8A8 as the format defines it: each row of x quantized to int8 (its own scale), an int32 GEMM.

    y[m, n] = (sum_k xq[m, k] * q[n, k]) * x_scale[m] * w_scale[n]
    """

    name = "int8-w8a8-cpu"
    q: torch.Tensor
    scales: torch.Tensor

    def __init__(self, w: QuantizedWeight) -> None:
        super().__init__()
        self.register_buffer("q", w.q.contiguous())
        self.register_buffer("scales", w.scales[:, 0].float().contiguous())

    @staticmethod
    def fits(w: QuantizedWeight) -> bool:
        return w.int8_activations and w.q.dtype == torch.int8 and w.zeros is None and w.group_size == w.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_scale = (x.abs().amax(dim=-1, keepdim=True).float() / 127.0).clamp(min=1e-12)
        xq = torch.round(x.float() / x_scale).to(torch.int8)
        # NOTE: q.T is a [K, N] view of the [N, K] weight, no copy
        return (torch._int_mm(xq, self.q.T).float() * x_scale * self.scales).to(x.dtype)


class TritonW4A16Kernel(nn.Module):
    """The CUDA W4A16 Triton GEMM (``pagedllm.kernels.quant_matmul``), dequantizing inside the kernel."""

    name = "w4a16-triton"
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        assert w.zeros is not None
        self.group_size, self.bits = w.group_size, w.bits
        # qweight: [K * bits / 32, N] packed along K; scales, zeros: [K / group, N]
        self.register_buffer("qweight", pack_int32(w.q.T.contiguous(), w.bits, dim=0))
        self.register_buffer("scales", w.scales.T.to(dtype).contiguous())
        self.register_buffer("zeros", w.zeros.T.to(dtype).contiguous())

    @staticmethod
    def fits(w: QuantizedWeight) -> bool:
        k = w.shape[1]
        packs = k % (32 // w.bits) == 0 if w.bits in (4, 8) else False
        return packs and w.q.dtype == torch.uint8 and w.zeros is not None and k % w.group_size == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pagedllm.kernels.quant_matmul import w4a16_matmul

        return w4a16_matmul(x, self.qweight, self.scales, self.zeros, self.group_size, bits=self.bits)


def choose_kernel(w: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The fastest kernel that runs ``w`` exactly on ``device`` for activations of ``dtype`` (exactly but
    for activations rounded to int8 where the format says so, W8A8, or where ``w4a8-tiles`` and
    ``w8a8-tiles`` run)."""
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16):
        if dtype == torch.bfloat16 and W4A16TilesKernel.fits(w):
            return W4A16TilesKernel(w)
        if dtype == torch.bfloat16 and W8A8TilesKernel.fits(w):
            return W8A8TilesKernel(w)
        if Int4CpuKernel.fits(w):
            return Int4CpuKernel(w, dtype)
        if Int8W8A8CpuKernel.fits(w):
            return Int8W8A8CpuKernel(w)
        if Int8CpuKernel.fits(w):
            return Int8CpuKernel(w, dtype)
    if device.type == "cuda":
        return _choose_cuda_kernel(w, device, dtype)
    return DequantizeKernel(w)


def _choose_cuda_kernel(w: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> nn.Module:
    if TritonW4A16Kernel.fits(w):
        return TritonW4A16Kernel(w, dtype)
    if w.q.dtype == torch.float8_e4m3fn:
        fp8 = choose_fp8_kernel(w, device)
        if fp8 is not None:
            return fp8
    return DequantizeKernel(w)
