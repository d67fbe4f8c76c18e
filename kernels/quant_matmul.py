"""Weight-only quantized matmul (W4A16 / W8A16): ``y = x @ dequant(qweight)``, the weight
dequantized tile by tile inside the GEMM, never written out whole.

The packed layout is GPTQ's (AutoGPTQ / compressed-tensors ``pack-quantized`` after
transposing): ``32 // bits`` consecutive rows k of one column n share an int32 word,
element k at bits ``(k % pack) * bits`` upward::

    qweight [K * bits // 32, N] int32       (bits = 4: pack = 8 rows per word)
    word (r, n) = q[8r, n] | q[8r+1, n] << 4 | ... | q[8r+7, n] << 28

    w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]
    g = g_idx[k]  (GPTQ act-order)  or  k // group_size

Tiles. Decode (M <= 64) reads each weight byte once and is bound by memory bandwidth:
the row tile is the smallest ``tl.dot`` takes (16, or M rounded up to a power of two),
the column tile is narrow (32) so a 4096-wide layer still gives 128 programs for the 132
SMs of an H100, and the K tile is long (128, or the group when smaller) so each program
streams long runs of packed words with few loop trips. Prefill (M > 64) is bound by
arithmetic: 64x128 or 128x128 output tiles reuse each dequantized weight tile over many
rows, K tile 64. When no ``g_idx`` is given and the group is a multiple of the K tile, a
tile lies inside one group and loads one row of scales and zeros; otherwise (act-order)
each of the tile's rows gathers its own group's. Each packed word is loaded once per tile and
repeated in registers for its rows: loading it once per row instead pipelined a tile 8x the
size through shared memory (compiled for sm90: 61 KB against 18 KB at the decode tiles, and
the larger swept tiles did not fit at all). These are choices by reasoning and compiler
output, not yet by measurement: ``benchmarks/gpu_quant_linear.py --sweep-tiles`` measures them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import check_can_launch, next_pow2, tl, triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BITS = (4, 8)
DECODE_MAX_ROWS = 64


@dataclass(frozen=True)
class Tiles:
    """One launch's tile sizes and Triton launch options."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def quant_matmul_kernel(
    x_ptr,  # [M, K] float
    qweight_ptr,  # [K // PACK, N] int32
    scales_ptr,  # [groups, N] float
    zeros_ptr,  # [groups, N] float
    g_idx_ptr,  # [K] int32 (read only if HAS_G_IDX)
    y_ptr,  # [M, N], x's dtype
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_xk,
    stride_qk,
    stride_qn,
    stride_sg,
    stride_sn,
    stride_zg,
    stride_zn,
    stride_ym,
    stride_yn,
    BITS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    TILE_IN_ONE_GROUP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        # NOTE: each word is loaded once, then repeated for the PACK rows it holds (each keeps its own bits)
        word_rows = k0 // PACK + tl.arange(0, BLOCK_K // PACK).to(tl.int64)
        packed = tl.load(
            qweight_ptr + word_rows[:, None] * stride_qk + cols[None, :] * stride_qn,
            mask=(word_rows < K // PACK)[:, None] & col_ok[None, :],
            other=0,
        )  # [BLOCK_K // PACK, BLOCK_N] int32
        words = tl.reshape(tl.broadcast_to(packed[:, None, :], (BLOCK_K // PACK, PACK, BLOCK_N)), (BLOCK_K, BLOCK_N))
        shifts = ((ks % PACK) * BITS).to(tl.int32)
        q = ((words >> shifts[:, None]) & ((1 << BITS) - 1)).to(tl.float32)
        if TILE_IN_ONE_GROUP:
            g = k0 // group_size
            s = tl.load(scales_ptr + g * stride_sg + cols * stride_sn, mask=col_ok, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + g * stride_zg + cols * stride_zn, mask=col_ok, other=0.0).to(tl.float32)
            w = (q - z[None, :]) * s[None, :]
        else:
            if HAS_G_IDX:
                g = tl.load(g_idx_ptr + ks, mask=k_ok, other=0).to(tl.int64)
            else:
                g = ks // group_size
            both = k_ok[:, None] & col_ok[None, :]
            s = tl.load(scales_ptr + g[:, None] * stride_sg + cols[None, :] * stride_sn, mask=both, other=0.0)
            z = tl.load(zeros_ptr + g[:, None] * stride_zg + cols[None, :] * stride_zn, mask=both, other=0.0)
            w = (q - z.to(tl.float32)) * s.to(tl.float32)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
    y = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def choose_tiles(m: int, group_size: int, has_g_idx: bool) -> Tiles:
    """Tile sizes for ``m`` rows (see the module docstring for why these)."""
    if m <= DECODE_MAX_ROWS:
        tiles = Tiles(max(16, next_pow2(m)), 32, 128, num_warps=4, num_stages=4)
    elif m <= 128:
        tiles = Tiles(64, 128, 64, num_warps=4, num_stages=3)
    else:
        tiles = Tiles(128, 128, 64, num_warps=8, num_stages=3)
    if not has_g_idx and 16 <= group_size < tiles.block_k and group_size == next_pow2(group_size):
        # NOTE: a K tile no longer than a power-of-two group keeps the one-row scale load
        tiles = Tiles(tiles.block_m, tiles.block_n, group_size, tiles.num_warps, tiles.num_stages)
    return tiles


def _check_args(x, qweight, scales, zeros, group_size, g_idx, bits) -> int:
    """Validate the arguments; return the group size with -1 (one group per column) resolved."""
    if bits not in _BITS:
        raise ValueError(f"bits must be one of {_BITS}, got {bits}")
    if x.dim() != 2 or qweight.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"x must be float [M, K] and qweight [K*bits/32, N], got {x.dtype} {tuple(x.shape)}, {tuple(qweight.shape)}"
        )
    k, n = x.shape[1], qweight.shape[1]
    if qweight.dtype != torch.int32 or qweight.shape[0] * (32 // bits) != k:
        raise ValueError(
            f"qweight must be int32 [K*{bits}/32 = {k * bits // 32}, N], got {qweight.dtype} {tuple(qweight.shape)}"
        )
    group_size = k if group_size == -1 else group_size
    if group_size <= 0:
        raise ValueError(f"group_size must be positive or -1 (one group), got {group_size}")
    groups = -(-k // group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.shape != (groups, n) or not t.is_floating_point():
            raise ValueError(f"{name} must be float [K/group_size = {groups}, N = {n}], got {t.dtype} {tuple(t.shape)}")
    if g_idx is not None and (g_idx.shape != (k,) or g_idx.dtype != torch.int32):
        raise ValueError(f"g_idx must be int32 [K = {k}], got {g_idx.dtype} {tuple(g_idx.shape)}")
    return group_size


def w4a16_matmul(
    x: torch.Tensor,  # [M, K] float16, bfloat16 or float32
    qweight: torch.Tensor,  # [K * bits // 32, N] int32, packed along K
    scales: torch.Tensor,  # [ceil(K / group_size), N] float
    zeros: torch.Tensor,  # [ceil(K / group_size), N] float (the zero point as a value, not packed)
    group_size: int,  # -1: one group for all of K
    g_idx: torch.Tensor | None = None,  # [K] int32: group of each row of K (act-order)
    bits: int = 4,  # 4 or 8
    *,
    tiles: Tiles | None = None,  # override :func:`choose_tiles` (benchmarks sweep them)
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ W`` with ``W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]`` (Triton, float32 accumulation).

    ``q`` is unpacked and dequantized inside the kernel, one tile at a time; see the
    module docstring for the packing and the tile sizes.
    """
    group_size = _check_args(x, qweight, scales, zeros, group_size, g_idx, bits)
    check_can_launch(quant_matmul_kernel, x, qweight, scales, zeros, *([g_idx] if g_idx is not None else []))
    (m, k), n = x.shape, qweight.shape[1]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    tiles = tiles or choose_tiles(m, group_size, g_idx is not None)
    if min(tiles.block_m, tiles.block_n, tiles.block_k) < 16 or tiles.block_k % (32 // bits):
        raise ValueError(f"tiles must be at least 16 a side with block_k a multiple of {32 // bits}, got {tiles}")
    one_group = g_idx is None and group_size % tiles.block_k == 0
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    quant_matmul_kernel[grid](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, y,
        m, n, k, group_size,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
        scales.stride(0), scales.stride(1), zeros.stride(0), zeros.stride(1),
        y.stride(0), y.stride(1),
        BITS=bits,
        HAS_G_IDX=g_idx is not None,
        TILE_IN_ONE_GROUP=one_group,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip
    return y


def pack_along_k(q: torch.Tensor, bits: int) -> torch.Tensor:  # [K, N] ints -> [K * bits // 32, N] int32
    """Pack ``q`` (values in ``[0, 2**bits)``), ``32 // bits`` rows a word, as :func:`w4a16_matmul` reads it."""
    pack = 32 // bits
    if q.shape[0] % pack:
        raise ValueError(f"K = {q.shape[0]} must be a multiple of {pack} to pack {bits}-bit values")
    shifts = torch.arange(pack, device=q.device, dtype=torch.int64) * bits  # [pack]
    parts = q.to(torch.int64).view(-1, pack, q.shape[1]) << shifts[None, :, None]
    words = parts.sum(dim=1)  # [K // pack, N], each < 2**32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_along_k(qweight: torch.Tensor, bits: int) -> torch.Tensor:  # [K // pack, N] int32 -> [K, N] int64
    """The ``[K, N]`` values packed in ``qweight`` (inverse of :func:`pack_along_k`)."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=qweight.device, dtype=torch.int64) * bits  # [pack]
    q = (qweight.to(torch.int64)[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return q.reshape(-1, qweight.shape[1])


def dequantize_reference(qweight, scales, zeros, group_size, g_idx=None, bits=4) -> torch.Tensor:  # [K, N] float32
    """The weight ``W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]`` in float32."""
    q = unpack_along_k(qweight, bits)
    k = q.shape[0]
    group_size = k if group_size == -1 else group_size
    g = g_idx.long() if g_idx is not None else torch.arange(k, device=q.device) // group_size
    return (q.float() - zeros.float()[g]) * scales.float()[g]


def w4a16_matmul_reference(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K * bits // 32, N] int32
    scales: torch.Tensor,  # [groups, N]
    zeros: torch.Tensor,  # [groups, N]
    group_size: int,
    g_idx: torch.Tensor | None = None,  # [K] int32
    bits: int = 4,
) -> torch.Tensor:  # [M, N] in x's dtype
    """Plain-torch twin of :func:`w4a16_matmul`: dequantize the whole weight, then one float32 matmul."""
    group_size = _check_args(x, qweight, scales, zeros, group_size, g_idx, bits)
    w = dequantize_reference(qweight, scales, zeros, group_size, g_idx, bits)
    return (x.float() @ w).to(x.dtype)
