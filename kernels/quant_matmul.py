"""Weight-only quantized matmul (W4A16 / W8A16): ``y = x @ dequant(qweight)``, the weight
dequantized tile by tile inside the GEMM, never written out whole.

The packed layout is GPTQ's (AutoGPTQ / compressed-tensors ``pack-quantized`` after
transposing): ``32 // bits`` consecutive rows k of one column n share an int32 word,
element k at bits ``(k % pack) * bits`` upward::

    qweight [K * bits // 32, N] int32       (bits = 4: pack = 8 rows per word)
    word (r, n) = q[8r, n] | q[8r+1, n] << 4 | ... | q[8r+7, n] << 28

    w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]
    g = g_idx[k]  (GPTQ act-order)  or  k // group_size

Tiles. Decode (M <= 64) reads each weight byte once, so the tiles aim at keeping the memory
busy: a 16x32 output tile with a K tile of 128, one program per 32 columns streaming all of K,
left Llama-3-8B's projections on an H200 at 7-13% of the bandwidth floor whatever the rows, with
2 KB of packed weight per loop trip and about 1.5 programs per SM. The decode tiles split K
across programs for more of them::

    K:  |<-- slice 0 -->|<-- slice 1 -->| ... |<-- slice S-1 -->|    S = split_k, each slice
        program (i, j, s) sums slice s into partials[s, tile i, tile j]   whole K tiles (float32)
    y[tile i, tile j] = partials[0] + ... + partials[S-1]   (one small launch, x's dtype)

They are the fastest of 33 tile sizes swept at one row on an H200 for those projections
(``benchmarks/gpu_quant_linear.py --sweep-tiles``): a 16x64 output tile, K tile 128 (4 KB of
packed words a trip), 4 warps, 4 stages, K split in two until a slice would hold fewer than 8
K tiles (4 splits at K 4096, 8 at 14336). Against the 16x32 tile in the same run: q/k/v 39.1 ->
26.2 us, o 31.7 -> 19.7, gate/up 111.2 -> 102.3, down 104.6 -> 56.4, still 11-14% of the
floor. Every swept tile stayed under 15%, 256- and 512-deep K tiles and 8 warps among them, so
the time is not set by the bytes in flight alone. As rows grow the split is capped so the
float32 partial sums move at most an eighth of the weight's bytes (unmeasured above one row).
Prefill (M > 64) is bound by arithmetic: 64x128 or 128x128 output tiles reuse each dequantized
weight tile over many rows, K tile 64, no split; chosen by reasoning, not yet measured.

When no ``g_idx`` is given and a K tile lies inside one group or holds whole groups (both
powers of two), the tile loads one row of scales and zeros per group and repeats it in
registers for the group's rows; otherwise (act-order) each of the tile's rows gathers its own
group's. Each packed word is loaded once per tile and repeated in registers for its rows:
loading it once per row instead pipelined a tile 8x the size through shared memory (compiled
for sm90: 61 KB against 18 KB at the 16x32 tile, and the larger swept tiles did not fit at
all).

One row: :mod:`pagedllm.kernels.quant_gemv` runs without ``tl.dot`` (``Tiles(kind="gemv")``,
1 to ``GEMV_MAX_ROWS`` rows). On an H200 it took a 4-bit row of Llama-3-8B's projections 1.8-2.3x
faster than the tiles above (q/k/v 26.3 -> 14.2 us, o 19.7 -> 11.1, gate/up 102.6 -> 43.8;
19-34% of the floor), so :func:`choose_tiles` returns it for one row of 4-bit weights without
act-order: 64 columns, a K tile of 256, 4 warps (the fastest tile on two of the three), K split
in up to four slices of at least four K tiles. 8-bit weights and 2-64 rows keep the tiles
above: no GPU has compared the gemv with them there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from ._triton import check_can_launch, next_pow2, tl, triton
from .quant_gemv import check_gemv, launch_gemv

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BITS = (4, 8)
DECODE_MAX_ROWS = 64
_SUM_BLOCK = 1024  # outputs per program of the split-K sum
DECODE_MIN_TRIPS = 8
"""K tiles each split of K keeps at decode: 4-tile slices ran up to 6% slower in the sweep."""
GEMV_MIN_TRIPS = 4
"""K tiles each split of K keeps for the gemv kernel at one row: the sweep's winners split K 4096 in four."""
TileKind = Literal["dot", "gemv"]


@dataclass(frozen=True)
class Tiles:
    """One launch's tile sizes and Triton launch options."""

    block_m: int
    """Rows of x (and y) per program."""
    block_n: int
    """Columns of the weight (and y) per program."""
    block_k: int
    """Rows of K per loop trip; a multiple of the rows one int32 word packs."""
    num_warps: int
    num_stages: int
    split_k: int = 1
    """Programs sharing one output tile, each over a contiguous slice of whole K tiles."""
    kind: TileKind = "dot"
    """``"dot"``: :func:`quant_matmul_kernel` (``tl.dot``); ``"gemv"``: the kernel of
    :mod:`pagedllm.kernels.quant_gemv`, ``block_m`` (a power of two, ``m <= block_m <=
    GEMV_MAX_ROWS``) rows in one program; unmeasured."""


@triton.jit
def _repeat_rows(t, REPEATS: tl.constexpr):  # [R, C] -> [R * REPEATS, C], row r at r*REPEATS .. +REPEATS-1
    rows_in: tl.constexpr = t.shape[0]
    cols: tl.constexpr = t.shape[1]
    return tl.reshape(tl.broadcast_to(t[:, None, :], (rows_in, REPEATS, cols)), (rows_in * REPEATS, cols))


@triton.jit
def quant_matmul_kernel(
    x_ptr,  # [M, K] float
    qweight_ptr,  # [K // PACK, N] int32
    scales_ptr,  # [groups, N] float
    zeros_ptr,  # [groups, N] float
    g_idx_ptr,  # [K] int32 (read only if HAS_G_IDX)
    y_ptr,  # [M, N] in x's dtype, or [SPLIT_K, M, N] float32 partial sums when SPLIT_K > 1
    M,
    N,
    K,
    group_size,
    k_per_split,  # a multiple of BLOCK_K (read only if SPLIT_K > 1)
    stride_xm,
    stride_xk,
    stride_qk,
    stride_qn,
    stride_sg,
    stride_sn,
    stride_zg,
    stride_zn,
    stride_ys,
    stride_ym,
    stride_yn,
    BITS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    GROUPS_PER_TILE: tl.constexpr,  # whole groups a K tile holds (1: inside one group); 0: gather per row
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    k_start, k_end = 0, K
    if SPLIT_K > 1:
        # NOTE: slices are whole K tiles, so every tile starts where it would unsplit (group alignment holds)
        k_start = tl.program_id(2) * k_per_split
        k_end = tl.minimum(K, k_start + k_per_split)
        y_ptr += tl.program_id(2).to(tl.int64) * stride_ys
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
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
        words = _repeat_rows(packed, PACK)  # [BLOCK_K, BLOCK_N]
        shifts = ((ks % PACK) * BITS).to(tl.int32)
        q = ((words >> shifts[:, None]) & ((1 << BITS) - 1)).to(tl.float32)
        if GROUPS_PER_TILE == 1:
            g = k0 // group_size
            s = tl.load(scales_ptr + g * stride_sg + cols * stride_sn, mask=col_ok, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + g * stride_zg + cols * stride_zn, mask=col_ok, other=0.0).to(tl.float32)
            w = (q - z[None, :]) * s[None, :]
        elif GROUPS_PER_TILE > 1:
            g = k0 // group_size + tl.arange(0, GROUPS_PER_TILE).to(tl.int64)
            both = (g * group_size < K)[:, None] & col_ok[None, :]  # a last tile may run past K's last group
            s = tl.load(scales_ptr + g[:, None] * stride_sg + cols[None, :] * stride_sn, mask=both, other=0.0)
            z = tl.load(zeros_ptr + g[:, None] * stride_zg + cols[None, :] * stride_zn, mask=both, other=0.0)
            rows_per_group: tl.constexpr = BLOCK_K // GROUPS_PER_TILE
            w = (q - _repeat_rows(z.to(tl.float32), rows_per_group)) * _repeat_rows(s.to(tl.float32), rows_per_group)
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


@triton.jit
def split_k_sum_kernel(
    partials_ptr,  # [SPLIT_K, numel] float32, contiguous
    y_ptr,  # [numel] contiguous, the output's dtype
    numel,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.load(partials_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):  # NOTE: a fixed order, so the sum is the same every run
        acc += tl.load(partials_ptr + s * numel + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def choose_tiles(m: int, k: int, group_size: int, has_g_idx: bool, bits: int = 4) -> Tiles:
    """Tile sizes for ``x [m, k] @ W [k, n]`` (see the module docstring for why these).

    The decode tiles are the fastest of one sweep at one row on an H200, where the best tiles
    did not depend on ``n`` (4096 to 28672); the prefill tiles are chosen by reasoning, not yet
    measured. ``group_size`` and ``has_g_idx`` do not change them: the kernel loads a tile's
    scales once per whole group it holds, and act-order gathers per row at any tile size.
    One row of 4-bit weights without act-order takes the gemv kernel (also the sweep's winner).
    """
    if m == 1 and bits == 4 and not has_g_idx and group_size % (32 // bits) == 0:
        return _gemv_tiles(k)
    if m <= DECODE_MAX_ROWS:
        return _decode_tiles(m, k)
    if m <= 128:
        return Tiles(64, 128, 64, num_warps=4, num_stages=3)
    return Tiles(128, 128, 64, num_warps=8, num_stages=3)


def _decode_tiles(m: int, k: int) -> Tiles:
    """16x64 output tiles, K tile 128, 4 warps, 4 stages, and K split in two until a slice would
    hold fewer than ``DECODE_MIN_TRIPS`` K tiles or the float32 partial sums (written, then read)
    would move more than an eighth of the 4-bit weight's bytes."""
    block_m, block_k, split = max(16, next_pow2(m)), 128, 1
    # per column: partial sums 4 B written + 4 B read per split and row; weight k / 2 B
    while k >= 2 * split * block_k * DECODE_MIN_TRIPS and 8 * (2 * split) * m <= k / 2 / 8:
        split *= 2
    return Tiles(block_m, 64, block_k, num_warps=4, num_stages=4, split_k=split)


def _gemv_tiles(k: int) -> Tiles:
    """One row through the gemv kernel: 64 columns, K tile 256, 4 warps, K split in two (up to four
    slices) while each slice keeps ``GEMV_MIN_TRIPS`` K tiles."""
    block_k, split = 256, 1
    while split < 4 and k >= 2 * split * block_k * GEMV_MIN_TRIPS:
        split *= 2
    return Tiles(1, 64, block_k, num_warps=4, num_stages=1, split_k=split, kind="gemv")


def _groups_per_tile(group_size: int, block_k: int, has_g_idx: bool) -> int:
    """Whole groups one K tile holds (1: it lies inside one group), or 0 where its rows gather their own."""
    if has_g_idx:
        return 0
    if group_size % block_k == 0:
        return 1
    if block_k % group_size == 0 and group_size == next_pow2(group_size):
        return block_k // group_size
    return 0


def _check_tiles(tiles: Tiles, bits: int, m: int, group_size: int, has_g_idx: bool) -> None:
    if tiles.kind not in get_args(TileKind):
        raise ValueError(f"tiles.kind must be one of {get_args(TileKind)}, got {tiles.kind!r}")
    sides = (tiles.block_n, tiles.block_k) if tiles.kind == "gemv" else (tiles.block_m, tiles.block_n, tiles.block_k)
    if min(sides) < 16 or tiles.block_k % (32 // bits) or tiles.split_k < 1:
        raise ValueError(
            f"tiles must be at least 16 a side (gemv's block_m aside) with block_k a multiple of {32 // bits} "
            f"and split_k >= 1, got {tiles}"
        )
    if tiles.kind == "gemv":
        check_gemv(tiles, m, group_size, has_g_idx, bits)


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
    tiles = tiles or choose_tiles(m, k, group_size, g_idx is not None, bits)
    _check_tiles(tiles, bits, m, group_size, g_idx is not None)
    split = tiles.split_k
    # NOTE: split-K partial sums go to a float32 [split, M, N] buffer that one more small kernel
    # adds up in a fixed order and casts: one extra launch and no memset. Atomic adds into a
    # zeroed float32 buffer would take two (the zeroing and the cast), atomic adds into y itself
    # one (the zeroing) but round every partial to x's dtype; and both make the sum's order,
    # so its last bits, change from run to run.
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split), tiles.block_k) * tiles.block_k
    launch = launch_gemv if tiles.kind == "gemv" else _launch_dot
    launch(x, qweight, scales, zeros, g_idx, out, group_size, k_per_split, bits, tiles)
    if split > 1:
        split_k_sum_kernel[(triton.cdiv(m * n, _SUM_BLOCK),)](out, y, m * n, SPLIT_K=split, BLOCK=_SUM_BLOCK)
    return y


def _launch_dot(x, qweight, scales, zeros, g_idx, out, group_size, k_per_split, bits, tiles: Tiles) -> None:
    (m, k), n, split = x.shape, qweight.shape[1], tiles.split_k
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), split)
    quant_matmul_kernel[grid](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, out,
        m, n, k, group_size, k_per_split,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
        scales.stride(0), scales.stride(1), zeros.stride(0), zeros.stride(1),
        out.stride(0) if split > 1 else 0, out.stride(-2), out.stride(-1),
        BITS=bits,
        HAS_G_IDX=g_idx is not None,
        GROUPS_PER_TILE=_groups_per_tile(group_size, tiles.block_k, g_idx is not None),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        SPLIT_K=split,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip


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
