"""The gemv kernel of the 4-bit/8-bit weight-only matmul (:mod:`pagedllm.kernels.quant_matmul`)
for 1 to ``GEMV_MAX_ROWS`` rows: ``w4a16_matmul(..., tiles=Tiles(..., kind="gemv"))``, and the
default for one row of 4-bit weights (1.8-2.3x the tensor-core tiles' speed on an H200).

Why it exists: no swept tile lifted the GEMM past 15% of the floor
at one row, so it is not short of bytes in flight; compiled for sm90, each of its trips writes
the dequantized tile to shared memory and reads it back in ``tl.dot``'s operand layout, work a
product of a few rows has no use for. ``Tiles(kind="gemv")`` runs :func:`quant_gemv_kernel`
instead: up to ``GEMV_MAX_ROWS`` rows in one program, no ``tl.dot``; each trip loads the packed
words once and, for each of the ``pack`` codes a word holds, multiplies in the x of that code's
k, summing in float32 per row, word and column in the layout the words load in (compiled for
sm90 at the swept gemv tiles: no shared memory, no barrier in the loop), over the words once
after it. Split-K as the GEMM's; ``g_idx`` is refused.
:func:`~pagedllm.kernels.quant_matmul.choose_tiles` returns it for one row of 4-bit weights
without act-order; at 2-4 rows and for 8-bit weights it competes in the sweep only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._triton import next_pow2, tl, triton

if TYPE_CHECKING:
    from .quant_matmul import Tiles

GEMV_MAX_ROWS = 4
"""Most rows the gemv kernel takes, all in one program: each thread keeps a float32 sum per row for
every packed word it holds. Compiled for sm90 at 16 words a thread, 1 row took 64 registers and 4
rows all 255; 4 rows of 32 words spilled. Each row also adds an FMA per weight to the ~6.5
instructions a weight costs at one row, so more rows belong to the tensor-core tile, which reuses
each dequantized weight across them."""


@triton.jit
def _rows_of_x(x_ptr, ks, k_ok, rows, M, stride_xm, stride_xk, ROWS: tl.constexpr):
    """``x[rows, ks]`` in float32, ``ks`` [1, WORDS, 1] -> [ROWS, WORDS, 1], 0 past M or K; a row a
    load (see :func:`quant_gemv_kernel`)."""
    x = tl.zeros([ROWS, ks.shape[1], 1], dtype=tl.float32)
    for r in tl.static_range(ROWS):
        x_r = tl.load(x_ptr + r * stride_xm + ks * stride_xk, mask=tl.where(r < M, k_ok, False), other=0.0)
        x = tl.where(rows == r, x_r.to(tl.float32), x)
    return x


@triton.jit
def quant_gemv_kernel(
    x_ptr,  # [M, K] float, M <= ROWS
    qweight_ptr,  # [K // PACK, N] int32
    scales_ptr,  # [groups, N] float
    zeros_ptr,  # [groups, N] float
    y_ptr,  # [M, N] in x's dtype, or [SPLIT_K, M, N] float32 partial sums when SPLIT_K > 1
    M,
    N,
    K,
    group_size,  # a multiple of PACK
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
    TILE_IN_ONE_GROUP: tl.constexpr,  # else each packed word loads its own group's scale and zero
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PACK
    # NOTE: every tensor is [rows, words, columns], 1 where it does not vary, so the arithmetic runs
    # in the layout the packed words load in. A load of as many elements as the program has threads
    # (32 * num_warps) or more fixes a layout of its own, and every trip then converts the tile to it
    # through shared memory (compiled for sm90): so x is loaded a row at a time, and a K tile inside
    # one group wants BLOCK_N below the thread count for its row of scales
    rows = tl.arange(0, ROWS).to(tl.int64)[:, None, None]
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)[None, None, :]
    col_ok = cols < N
    k_start, k_end = 0, K
    if SPLIT_K > 1:
        # NOTE: slices are whole K tiles, so every tile starts where it would unsplit (group alignment holds)
        k_start = tl.program_id(1) * k_per_split
        k_end = tl.minimum(K, k_start + k_per_split)
        y_ptr += tl.program_id(1).to(tl.int64) * stride_ys
    acc = tl.zeros([ROWS, WORDS, BLOCK_N], dtype=tl.float32)  # summed over the words after the loop
    for k0 in range(k_start, k_end, BLOCK_K):
        words = k0 // PACK + tl.arange(0, WORDS).to(tl.int64)[None, :, None]
        word_ok = words < K // PACK
        packed = tl.load(qweight_ptr + words * stride_qk + cols * stride_qn, mask=word_ok & col_ok, other=0)
        if TILE_IN_ONE_GROUP:
            g, g_ok = tl.full([1, 1, 1], k0 // group_size, tl.int64), col_ok
        else:
            g, g_ok = words * PACK // group_size, word_ok & col_ok  # [1, WORDS, 1]
        s = tl.load(scales_ptr + g * stride_sg + cols * stride_sn, mask=g_ok, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + g * stride_zg + cols * stride_zn, mask=g_ok, other=0.0).to(tl.float32)
        a, c = s * (1 << BITS), (z + (1 << BITS)) * s  # (1 + q / 2**BITS) * a - c = (q - z) * s
        for j in tl.static_range(PACK):
            # x at the k of each word's bits j*BITS upward: [ROWS, WORDS, 1]
            x = _rows_of_x(x_ptr, words * PACK + j, word_ok, rows, M, stride_xm, stride_xk, ROWS)
            # NOTE: code j moved to the top of the mantissa of 1.0 reads as 1 + q / 2**BITS exactly: a
            # shift and one logic op instead of an int-to-float convert, which runs at a fraction of
            # the FMA rate; c takes the 1 back
            if j * BITS <= 23 - BITS:
                bits = packed << (23 - BITS - j * BITS)
            else:
                bits = packed >> (j * BITS - 23 + BITS)
            f = ((bits & (((1 << BITS) - 1) << (23 - BITS))) | 0x3F800000).to(tl.float32, bitcast=True)
            acc += x * (f * a - c)
    y = y_ptr + rows * stride_ym + cols * stride_yn  # [ROWS, 1, BLOCK_N]
    tl.store(y, tl.sum(acc, axis=1, keep_dims=True).to(y_ptr.dtype.element_ty), mask=(rows < M) & col_ok)


def check_gemv(tiles: Tiles, m: int, group_size: int, has_g_idx: bool, bits: int) -> None:
    """What the gemv kernel does not take: more rows than its ``block_m``, act-order, groups that split a word."""
    if not m <= tiles.block_m <= GEMV_MAX_ROWS or tiles.block_m != next_pow2(tiles.block_m):
        raise ValueError(
            f"gemv tiles take block_m rows, a power of two from M = {m} to {GEMV_MAX_ROWS}, got block_m {tiles.block_m}"
        )
    if has_g_idx:
        raise ValueError("gemv tiles do not take g_idx (act-order): use the dot tiles")
    if group_size % (32 // bits):
        raise ValueError(
            f"gemv tiles need group_size a multiple of the {32 // bits} {bits}-bit codes a word packs, got {group_size}"
        )


def launch_gemv(x, qweight, scales, zeros, g_idx, out, group_size, k_per_split, bits, tiles: Tiles) -> None:
    (m, k), n, split = x.shape, qweight.shape[1], tiles.split_k
    quant_gemv_kernel[(triton.cdiv(n, tiles.block_n), split)](
        x, qweight, scales, zeros, out,
        m, n, k, group_size, k_per_split,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
        scales.stride(0), scales.stride(1), zeros.stride(0), zeros.stride(1),
        out.stride(0) if split > 1 else 0, out.stride(-2), out.stride(-1),
        BITS=bits,
        TILE_IN_ONE_GROUP=group_size % tiles.block_k == 0,
        ROWS=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        SPLIT_K=split,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip
