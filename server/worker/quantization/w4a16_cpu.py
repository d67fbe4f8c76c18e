"""The 4-bit weight-only CPU kernel for bfloat16 activations: ``pagedllm.kernels.w4_gemm_cpu``'s tiles.

It reads the weight as 4-bit pairs and widens them in registers (no widened copy of the weight is
ever written), for every row count: in one quick in-process comparison on a shared 2-core
AVX-512-BF16 EPYC (Qwen2.5-0.5B's gate/up projection, 9728 x 896, group 128; one weight, called
again and again, so it may have stayed in the L3 cache) it took 0.12 / 0.61 / 2.4 / 9.6 ms at
1 / 16 / 64 / 256 rows on 1 thread against ``int4-cpu``'s 0.22 / 1.6 / 3.8 / 10.4 (its packed
matmul below 64 rows, the widened weight's GEMM from 64), and 0.10 / 0.18 / 1.3 ms at 1 / 8 / 64
rows on 2 threads against 0.15 / 0.46 / 2.7. ``python -m benchmarks.quant_linear --kernels engine
w4-tiles bf16`` compares them on weights read from memory.

Where the int8 product runs (``w4_gemm_cpu.int8_available``: AVX-512-VNNI and VBMI, or AVX2's
VPMADDUBSW) the weight runs against x rounded to int8 per row and group instead (``w4a8-tiles``;
on AVX2 packed in spans, ``w4_gemm_cpu.int8_pack``): about twice as fast from a few rows on with
VNNI, where the product, not the weight's bytes, bounds a call (the kernel's module says by how
much), for x's rounding to 8 bits. On an AVX2 EPYC (Zen 3, 2 threads, a Qwen2.5-0.5B layer from
memory) it took 0.37 / 1.92 / 7.3 ms at 1 / 16 / 64 rows against bfloat16 activations' 0.58 / 3.4 /
13.2 and bf16 weights' 0.89 / 3.1 / 11.6 in one run (``python -m benchmarks.quant_linear --threads 2
--layers 8 --rows 1 4 16 64 --kernels w4-tiles w4a8-tiles bf16``). ``PAGEDLLM_W4A8=0`` keeps
bfloat16 activations.

8-bit weights (:class:`W8A8TilesKernel`) take the same int8 product on the kernel's 8-bit packing:
per Qwen2.5-0.5B layer, two threads, 8 copies read from memory, 0.42 / 0.56 ms at 1 / 16 rows
against 0.49 / 1.73 for torch's int8 weight-only matmul and 0.62 / 0.82 in bfloat16
(``python -m benchmarks.quant_linear --rows 1 16 --kernels int8 w8a8-tiles w4a8-tiles bf16 --layers 8``).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels import w4_gemm_cpu
from pagedllm.server.worker.quantization.base import QuantizedWeight

W4_TILES_GROUPS = (32, 64, 128, 256)
CHANNEL_SPLIT = 128
"""A per-channel weight (one group of K) is kept as groups of this many inputs, its scale and zero
repeated: each float32 sum then runs over 128 inputs, not all of K (the cost: 8 bytes per 128 weights)."""


def kept_group(group: int, k: int) -> int:
    """The group a tiled layer keeps: :data:`CHANNEL_SPLIT` for a per-channel weight whose K divides into
    more than one, else the weight's own."""
    return CHANNEL_SPLIT if group == k and k % CHANNEL_SPLIT == 0 and k > CHANNEL_SPLIT else group


def split_channels(
    scales: torch.Tensor, zeros: torch.Tensor, group: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Scales and zeros repeated for the groups of :func:`kept_group` (a per-channel weight's split)."""
    kept = kept_group(group, k)
    if kept == group:
        return scales, zeros, group
    return scales.repeat_interleave(group // kept, 1), zeros.repeat_interleave(group // kept, 1), kept


class W4A16TilesKernel(nn.Module):
    """``x @ W.T`` for a 4-bit weight with zero points and bfloat16 activations, on the tiled CPU kernel
    (x rounded to int8 per row and group where ``int8``)."""

    name = "w4a16-tiles"
    label: str
    """What runs the product, for the banner and metrics (one kernel for every row count):
    ``w4a8-tiles`` where x is rounded to int8, else the name."""
    weight: torch.Tensor
    meta: torch.Tensor

    def __init__(self, w: QuantizedWeight, int8: bool | None = None) -> None:
        """``int8``: whether x is rounded to int8 (None: where ``w4_gemm_cpu.int8_available`` and the
        group, a multiple of 16, allow it)."""
        super().__init__()
        assert w.zeros is not None
        scales, zeros, group = split_channels(w.scales, w.zeros, w.group_size, w.shape[1])
        fits_int8 = group % w4_gemm_cpu.INT8_GROUP_MULTIPLE == 0
        if int8 and not (fits_int8 and w4_gemm_cpu.int8_available()):
            raise ValueError(
                f"int8 activations need AVX-512-VNNI and VBMI or AVX2, and groups of a multiple of 16, got {group}"
            )
        self.int8 = fits_int8 and w4_gemm_cpu.int8_available() if int8 is None else int8
        self.label = "w4a8-tiles" if self.int8 else self.name
        # NOTE: the AVX2 int8 product reads a layout of its own (pack_spans); the others read pack()'s
        pack = w4_gemm_cpu.int8_pack if self.int8 else w4_gemm_cpu.pack
        packed = pack(w.q, scales, zeros, group)
        # weight: [N / 16, K / 2, 16] (or [N / 16, K / 4, 32] in spans) uint8;
        # meta: [N / 16, K / group, 2, 16] float32 (scale, 128 + zero)
        self.register_buffer("weight", packed.weight)
        self.register_buffer("meta", packed.meta)
        self.group_size = group

    @staticmethod
    def fits(w: QuantizedWeight) -> bool:
        """4-bit uint8 levels with zero points, N a multiple of 16, groups of 32..256 inputs or one per
        channel (K even), on a CPU where the kernel builds and runs."""
        n, k = w.shape
        groups_ok = w.group_size in W4_TILES_GROUPS or (w.group_size == k and k % 2 == 0)
        shaped = w.bits == 4 and w.q.dtype == torch.uint8 and w.zeros is not None and groups_ok
        return shaped and w4_gemm_cpu.can_pack(w.q, w.group_size) and w4_gemm_cpu.available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, K] bfloat16 -> [rows, N]
        if self.int8:
            return int8_product(self)(x)
        return w4_gemm_cpu.gemm(x, w4_gemm_cpu.W4Packed(self.weight, self.meta, self.group_size))


class W8A8TilesKernel(nn.Module):
    """``x @ W.T`` for an 8-bit weight (GPTQ, compressed-tensors W8A16, ``--quantization int8``) with
    bfloat16 activations rounded to int8 per row and group, on the tiled CPU kernel's 8-bit packing
    (``w4_gemm_cpu.pack8``): VPDPBUSD multiplies the stored levels as they are, nothing widened."""

    name = "w8a8-tiles"
    label = name
    """What runs the product, for the banner and metrics (one kernel for every row count)."""
    int8 = True
    """x is rounded to int8 (always, as :attr:`W4A16TilesKernel.int8` where that is set)."""
    weight: torch.Tensor
    meta: torch.Tensor

    def __init__(self, w: QuantizedWeight) -> None:
        super().__init__()
        q, zeros = w.q, w.zeros
        if zeros is None:  # NOTE: signed levels, zero 0: the same values as unsigned ones around 128
            q, zeros = (q.to(torch.int16) + 128).to(torch.uint8), torch.full_like(w.scales, 128.0)
        scales, zeros, group = split_channels(w.scales, zeros, w.group_size, w.shape[1])
        packed = w4_gemm_cpu.pack8(q, scales, zeros, group)
        # weight: [N / 16, K / 4, 64] uint8; meta: [N / 16, K / group, 2, 16] float32 (scale, 128 + zero)
        self.register_buffer("weight", packed.weight)
        self.register_buffer("meta", packed.meta)
        self.group_size = group

    @staticmethod
    def fits(w: QuantizedWeight) -> bool:
        """8-bit levels, unsigned with zero points or signed without, N a multiple of 16 and K of 4, groups
        of a multiple of 16 inputs dividing K (or one per channel, split in 128s where K allows), not a
        format that fixes its own activation rounding (W8A8), on a CPU where ``gemm_int8`` runs."""
        n, k = w.shape
        signed = w.q.dtype == torch.int8 and w.zeros is None
        levels = (w.q.dtype == torch.uint8 and w.zeros is not None) or signed
        group = kept_group(w.group_size, k)
        grouped = group % w4_gemm_cpu.INT8_GROUP_MULTIPLE == 0 and k % group == 0
        shaped = w.bits == 8 and levels and not w.int8_activations and n % 16 == 0 and k % 4 == 0 and grouped
        return shaped and w4_gemm_cpu.w8_available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, K] bfloat16 -> [rows, N]
        return int8_product(self)(x)


def int8_product(kernel: W4A16TilesKernel | W8A8TilesKernel) -> w4_gemm_cpu.Int8Product:
    """The kernel's int8 product, made on its first call (and again where its buffers were replaced).

    NOTE: the buffers are read from ``_buffers``: the module's attribute lookup took ~1 us each against
    ~0.1, and a decode step makes ~100 of these calls."""
    product, buffers = kernel.__dict__.get("_int8_product"), kernel._buffers
    if product is None or product.packed.weight is not buffers["weight"] or product.packed.meta is not buffers["meta"]:
        product = w4_gemm_cpu.Int8Product(w4_gemm_cpu.W4Packed(kernel.weight, kernel.meta, kernel.group_size))
        kernel.__dict__["_int8_product"] = product
    return product
