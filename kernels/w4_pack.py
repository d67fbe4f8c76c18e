"""The 4- and 8-bit weight packings of kernels/w4_gemm_cpu.py (the products' module says how they are read).

::

    q [n, k] levels, scales / zeros [n, k / group] ──pack──► W4Packed: weight [n/16, k/2, 16] uint8,
        meta [n/16, k/group, 2, 16] float32 (scale, 128 + zero); pack_spans: weight [n/16, k/4, 32];
        pack8: weight [n/16, k/4, 64]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._cpu_memory import aligned_empty

__all__ = ["BLOCK", "W4Packed", "can_pack", "pack", "pack8", "pack_spans", "unpack"]

BLOCK = 16
"""Output columns per packed block: the weight's rows must be a multiple of it."""


class W4Packed(NamedTuple):
    """A 4-bit weight in the kernel's layout (both tensors 64-byte aligned, large ones on huge pages)."""

    weight: torch.Tensor
    """4-bit (:func:`pack`): [n / 16, k / 2, 16] uint8, byte c of pair p of block b holding
    q[16 b + c, 2 p] | q[16 b + c, 2 p + 1] << 4; 4-bit in spans (:func:`pack_spans`, the AVX2 int8
    product only): [n / 16, k / 4, 32], byte 2 c + e of span t holding q[16 b + c, 4 t + e] |
    q[16 b + c, 4 t + 2 + e] << 4; 8-bit (:func:`pack8`, :func:`gemm_int8` only): [n / 16, k / 4, 64]
    uint8, byte 4 c + i of quad t holding q[16 b + c, 4 t + i]. The last size tells them apart."""
    meta: torch.Tensor
    """[n / 16, k / group, 2, 16] float32: per block and group, the 16 columns' scales, then 128 + their zeros."""
    group: int


def can_pack(q: torch.Tensor, group: int) -> bool:
    """Whether :func:`pack` takes levels ``q`` [n, k] in groups of ``group`` inputs: uint8 on the CPU,
    n a multiple of :data:`BLOCK`, ``group`` even and dividing k."""
    if q.device.type != "cpu" or q.dtype != torch.uint8 or q.dim() != 2:
        return False
    n, k = q.shape
    return n % BLOCK == 0 and group > 0 and group % 2 == 0 and k % group == 0


def pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> W4Packed:
    """Levels ``q`` [n, k] (uint8, 0..15), ``scales`` and ``zeros`` [n, k / group] in the kernel's layout."""
    if not can_pack(q, group):
        raise ValueError(
            f"the CPU W4 GEMM packs uint8 CPU levels [n, k] with n a multiple of {BLOCK} and an even group "
            f"dividing k, got {tuple(q.shape)} {q.dtype} on {q.device}, group {group}"
        )
    n, k = q.shape
    _check_scales(scales, zeros, n, k // group)
    pairs = q.reshape(n // BLOCK, BLOCK, k // 2, 2).permute(0, 2, 1, 3)
    weight = aligned_empty(n * k // 2, torch.uint8).view(n // BLOCK, k // 2, BLOCK)
    weight.copy_(pairs[..., 0] | (pairs[..., 1] << 4))
    return W4Packed(weight, _meta(scales, zeros, group), group)


def pack8(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> W4Packed:
    """8-bit levels ``q`` [n, k] (uint8, 0..255), ``scales`` and ``zeros`` [n, k / group] in the layout
    :func:`gemm_int8` multiplies as it is: weight [n / 16, k / 4, 64], quad t of block b holding
    ``q[16 b + c, 4 t + i]`` at byte 4 c + i; meta as :func:`pack`'s. k a multiple of 4."""
    n, k = _checked_in_fours(q, scales, zeros, group, "the CPU W8 GEMM")
    weight = aligned_empty(n * k, torch.uint8).view(n // BLOCK, k // 4, 4 * BLOCK)
    weight.view(n // BLOCK, k // 4, BLOCK, 4).copy_(q.reshape(n // BLOCK, BLOCK, k // 4, 4).permute(0, 2, 1, 3))
    return W4Packed(weight, _meta(scales, zeros, group), group)


def pack_spans(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> W4Packed:
    """:func:`pack`'s levels, scales and zeros in the layout the AVX2 int8 product reads (k a multiple of 4):
    weight [n / 16, k / 4, 32], span t of block b holding inputs 4t..4t+3 of its 16 columns, byte 2 c + e
    ``q[16 b + c, 4 t + e] | q[16 b + c, 4 t + 2 + e] << 4``. A span's low nibbles are then pair 2t's levels,
    column c's two side by side, and its high nibbles pair 2t + 1's (kernels/w4_gemm_avx2.c says why)."""
    n, k = _checked_in_fours(q, scales, zeros, group, "the AVX2 int8 product")
    spans = q.reshape(n // BLOCK, BLOCK, k // 4, 2, 2).permute(0, 2, 1, 4, 3)  # [n/16, k/4, 16, e, low | high]
    weight = aligned_empty(n * k // 2, torch.uint8).view(n // BLOCK, k // 4, 2 * BLOCK)
    weight.view(n // BLOCK, k // 4, BLOCK, 2).copy_(spans[..., 0] | (spans[..., 1] << 4))
    return W4Packed(weight, _meta(scales, zeros, group), group)


def _checked_in_fours(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, packer: str
) -> tuple[int, int]:
    """n and k of levels a layout in fours of inputs takes, or a ValueError naming what does not fit."""
    if not can_pack(q, group) or q.shape[1] % 4:
        raise ValueError(
            f"{packer} packs uint8 CPU levels [n, k] with n a multiple of {BLOCK}, k of 4 and an even "
            f"group dividing k, got {tuple(q.shape)} {q.dtype} on {q.device}, group {group}"
        )
    n, k = q.shape
    _check_scales(scales, zeros, n, k // group)
    return n, k


def _check_scales(scales: torch.Tensor, zeros: torch.Tensor, n: int, groups: int) -> None:
    if scales.shape != (n, groups) or zeros.shape != (n, groups):
        got = f"{tuple(scales.shape)}, {tuple(zeros.shape)}"
        raise ValueError(f"scales and zeros must be [{n}, {groups}], got {got}")


def _meta(scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """[n / 16, groups, 2, 16] float32: per block and group the 16 columns' scales, then 128 + their zeros."""
    n, groups = scales.shape
    per_block = [t.float().reshape(n // BLOCK, BLOCK, -1).transpose(1, 2) for t in (scales, 128.0 + zeros.float())]
    meta = aligned_empty(n * groups * 2, torch.float32).view(n // BLOCK, groups, 2, BLOCK)
    meta.copy_(torch.stack(per_block, dim=2))
    return meta


def unpack(packed: W4Packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The levels [n, k] (uint8), scales and zeros [n, k / group] (float32) that :func:`pack` or
    :func:`pack_spans` packed."""
    blocks, runs, width = packed.weight.shape
    if width == 2 * BLOCK:  # spans: [n/16, k/4, 16, e] bytes, low nibble input 4t + e, high 4t + 2 + e
        nibbles = packed.weight.view(blocks, runs, BLOCK, 2)
        levels = torch.stack([nibbles & 15, nibbles >> 4], dim=-2)  # [n/16, k/4, 16, low | high, e]
        q = levels.permute(0, 2, 1, 3, 4).reshape(blocks * BLOCK, runs * 4)
    else:
        levels = torch.stack([packed.weight & 15, packed.weight >> 4], dim=-1)  # [n/16, k/2, 16, 2]
        q = levels.permute(0, 2, 1, 3).reshape(blocks * BLOCK, runs * 2)
    scales, offsets = (packed.meta[:, :, i].transpose(1, 2).reshape(blocks * BLOCK, -1) for i in (0, 1))
    return q, scales, offsets - 128.0
