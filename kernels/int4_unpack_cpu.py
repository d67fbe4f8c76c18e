"""torch's packed int4 CPU weight unpacked to a dense ``W.T`` in one compiled pass (Numba).

``torch.ops.aten._weight_int4pack_mm_for_cpu`` multiplies by a 4-bit weight without ever
widening it, which is what a decode step of a few rows wants: it reads a quarter of the bytes
of bfloat16. Its cost grows with every row, though (it widens each weight again for each block
of four rows, and multiplies in float32), while a dense oneDNN GEMM's hardly does. From some
row count on it pays to widen the weight once for the call and run the dense GEMM on it; this
kernel is that widening, reading the packed bytes and the group scales where they lie::

    packed [N / B, K, B / 2] uint8      byte (b, k, i): row Bb + i in its low nibble,
                                                         row Bb + B/2 + i in its high one
    scales_and_zeros [K / G, N, 2]      (scale, float offset) per group of G inputs
    out [K, N]                          W.T: out[k, n] = (q[n, k] - 8) * scale + offset

The layout is the one torch packs (``_convert_weight_to_int4pack_for_cpu``, checked at load by
:class:`~pagedllm.server.worker.quantization.kernels.Int4CpuKernel`). Its block B of output
rows follows the CPU torch runs on: 64 with AVX-512, 32 with AVX2 (:func:`torch_block` finds it
by packing a probe). Writing ``W.T`` keeps both
the bytes read and the elements written in order. Each element is computed in float32, one
multiply then one add (no fused multiply-add), and rounded once to the output dtype as torch
rounds: the result equals :func:`int4_unpack_reference` bit for bit, in float32 and bfloat16.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ._numba_cpu import KERNEL_DTYPES, compile_kernel, kernel_array
from .paged_decode_attention_cpu import HAS_NUMBA

if HAS_NUMBA:
    import numba

    from ._numba_cpu import load, store_like


@functools.cache
def torch_block() -> int:
    """Output rows per block of torch's packed CPU int4 weight on this CPU (64 or 32); 0 if it is neither."""
    q = torch.randint(0, 16, (64, 8), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return next((b for b in (64, 32) if torch.equal(unpack_levels(packed, b).int(), q)), 0)


def unpack_levels(packed: torch.Tensor, block: int) -> torch.Tensor:
    """The levels [N, K] (uint8) out of torch's packed bytes [N, K / 2], read with blocks of ``block`` rows."""
    n, k = packed.shape[0], packed.shape[1] * 2
    blocks = packed.reshape(n // block, k, block // 2)
    return torch.cat([blocks & 15, blocks >> 4], dim=2).transpose(1, 2).reshape(n, k)


def int4_unpack_reference(
    packed: torch.Tensor,  # [N, K / 2] uint8, torch's CPU int4 layout
    scales_and_zeros: torch.Tensor,  # [K / G, N, 2]
    group: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [K, N] in dtype
    """The dense ``W.T`` in torch ops: levels out of their nibbles, then ``(q - 8) * scale + offset`` in float32."""
    block = torch_block()
    if not block:
        raise ValueError("torch packs int4 CPU weights here in blocks of neither 64 nor 32 rows: cannot unpack them")
    levels = unpack_levels(packed, block).T.float()
    scales = scales_and_zeros[..., 0].float().repeat_interleave(group, dim=0)
    offsets = scales_and_zeros[..., 1].float().repeat_interleave(group, dim=0)
    return ((levels - 8) * scales + offsets).to(dtype)


def _kernel(packed, scales_and_zeros, group, first, out):  # pragma: no cover - compiled
    # packed: [N / B, K, B / 2] uint8; scales_and_zeros: [K / G, N, 2]; out: [K, width], columns first..
    k_total, half = packed.shape[1], packed.shape[2]
    size = 2 * half
    for tile_block in numba.prange(out.shape[1] // size):
        b = first // size + tile_block
        # NOTE: a group's B (scale, offset) pairs are read once into two unit-stride arrays: the
        # inner loop then vectorises (read as pairs in place, it runs ~20x slower)
        scales = np.empty(size, np.float32)
        offsets = np.empty(size, np.float32)
        for g in range(k_total // group):
            pairs = scales_and_zeros[g, b * size : b * size + size]
            for i in range(size):
                scales[i] = load(pairs[i, 0])
                offsets[i] = load(pairs[i, 1])
            for k in range(g * group, (g + 1) * group):
                row = packed[b, k]
                dst = out[k, tile_block * size : tile_block * size + size]
                for i in range(half):
                    byte = np.int32(row[i])
                    low = np.float32(byte & 15) - np.float32(8.0)
                    high = np.float32(byte >> 4) - np.float32(8.0)
                    dst[i] = store_like(low * scales[i] + offsets[i], out)
                    dst[i + half] = store_like(high * scales[i + half] + offsets[i + half], out)


@functools.cache
def _compiled(parallel: bool):
    return compile_kernel(_kernel, parallel)


def int4_unpack_cpu(
    packed: torch.Tensor,  # [N, K / 2] uint8, torch's CPU int4 layout (N a multiple of its block)
    scales_and_zeros: torch.Tensor,  # [K / G, N, 2], contiguous
    group: int,
    out: torch.Tensor,  # [K, width]: receives columns first .. first + width of W.T
    first: int = 0,
) -> torch.Tensor:  # out
    """Columns ``first ..`` of :func:`int4_unpack_reference` into ``out``, in one compiled pass where
    it can (float32 or bfloat16 ``out`` of the scales' dtype, whole blocks of :func:`torch_block` columns),
    else in torch ops.

    NOTE: a caller multiplying by the weight unpacks it a tile of columns at a time into one ``out``
    it reuses: a whole widened projection would take megabytes of fresh memory on every call.
    """
    n, k = packed.shape[0], packed.shape[1] * 2
    width = out.shape[1]
    usable = HAS_NUMBA and out.dtype in KERNEL_DTYPES and scales_and_zeros.dtype == out.dtype
    block = torch_block()
    aligned = block and n % block == 0 and first % block == 0 and width % block == 0 and first + width <= n
    if not (usable and aligned and packed.is_contiguous() and scales_and_zeros.is_contiguous() and out.is_contiguous()):
        dense = int4_unpack_reference(packed, scales_and_zeros, group, out.dtype)
        return out.copy_(dense[:, first : first + width])
    blocks = packed.view(n // block, k, block // 2).numpy()
    # NOTE: on the calling thread: a caller goes tile by tile, and a pass spread over threads would wait
    # for its slowest thread at every tile (on a shared machine, a scheduler time slice now and then)
    _compiled(False)(blocks, kernel_array(scales_and_zeros), group, first, kernel_array(out))
    return out
