"""Reading and writing paged K/V rows inside a Triton kernel, whatever the cache holds.

The attention kernels call :func:`load_kv_tile` where they would ``tl.load`` a tile; it
widens an 8-bit cache (kernels/kv_quant.py) to the query's dtype, so ``tl.dot`` runs as
it does on a 16-bit cache::

    KV_PLAIN  the model's dtype: loaded as is
    KV_FP8    float8 e4m3 / e5m2: widened, times the layer's per-tensor scale
    KV_INT8   int8 values, times the row's float16 scale (the row's last 2 bytes)

The KV write calls :func:`store_kv_rows`, which quantizes new rows as it stores them.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton
from .kv_quant import FP8_DTYPES

KV_PLAIN, KV_FP8, KV_INT8 = 0, 1, 2


def kv_format(cache: torch.Tensor) -> int:
    """The ``KV_QUANT`` constant a kernel gets for ``cache``."""
    if cache.dtype in FP8_DTYPES:
        return KV_FP8
    return KV_INT8 if cache.dtype == torch.int8 else KV_PLAIN


@triton.jit
def load_kv_tile(rows, d, row_mask, d_mask, scale, head_dim, KV_QUANT: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """``[BLOCK_N, BLOCK_D]`` values of the rows starting at ``rows`` (``[BLOCK_N, 1]`` pointers), in ``OUT_DTYPE``."""
    mask = row_mask[:, None] & d_mask[None, :]
    x = tl.load(rows + d[None, :], mask=mask, other=0.0)
    if KV_QUANT == 1:
        x = (x.to(tl.float32) * scale).to(OUT_DTYPE)
    elif KV_QUANT == 2:
        # NOTE: the scale's two bytes, little-endian, put back together as a float16
        lo = tl.load(rows + head_dim, mask=row_mask[:, None], other=0).to(tl.uint8).to(tl.uint16)
        hi = tl.load(rows + head_dim + 1, mask=row_mask[:, None], other=0).to(tl.uint8).to(tl.uint16)
        r = ((hi << 8) | lo).to(tl.float16, bitcast=True).to(tl.float32)
        x = (x.to(tl.float32) * r).to(OUT_DTYPE)
    return x


# NOTE: writing is the mirror of load_kv_tile: the kernels quantize in integer arithmetic
# and plain float32 operations (IEEE division, round-to-nearest-even everywhere), the
# steps of kv_quant.quantize on the CPU, so a cache holds the same bytes whichever device
# wrote it. Triton's own float32 -> fp8 casts are not used: its interpreter rounds them
# differently from torch, and a GPU's saturating conversions are not torch's either.


@triton.jit
def fp8_bits(v, E4M3: tl.constexpr):
    """Float32 ``v`` (already clamped to the format's range) as fp8 e4m3fn / e5m2 bits in int32,
    rounded to nearest-even as torch's ``.to(float8)`` rounds it."""
    u = v.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    u = u & 0x7FFFFFFF
    if E4M3:
        # below 2^-6 a subnormal: adding 2^14 leaves the value rounded to 2^-9 steps in the low bits
        sub = (tl.abs(v) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
        norm = (u - (120 << 23) + 0x7FFFF + ((u >> 20) & 1)) >> 20
        bits = tl.where(u < (121 << 23), sub, norm)
        bits = tl.where(u >= (1087 << 20), 0x7F, bits)  # 480 and up, or NaN: NaN
    else:
        sub = (tl.abs(v) + 128.0).to(tl.int32, bitcast=True) - (134 << 23)  # below 2^-14: 2^-16 steps
        norm = (u - (112 << 23) + 0xFFFFF + ((u >> 21) & 1)) >> 21
        bits = tl.where(u < (113 << 23), sub, norm)
        bits = tl.where(u >= (143 << 23), tl.where(u > 0x7F800000, 0x7F, 0x7C), bits)  # inf, NaN
    return bits | sign


@triton.jit
def int8_row_scale(x):
    """The float16 scale of each row of float32 ``x`` ``[R, D]`` as its 16 bits (int32 ``[R]``):
    ``max|x| / 127`` rounded to float16, one step up where that rounded it down."""
    amax = tl.max(tl.abs(x), axis=1)
    r = tl.maximum(tl.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)), 2.0**-24)
    bits = r.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    low = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 127.0 < amax
    return tl.where(low & (bits < 0x7BFF), bits + 1, bits)


@triton.jit
def int8_values(x, r_bits):
    """``round(x / r)`` clamped to +-127 (ties to even), ``r`` the rows' float16 scales' bits ``[R]``."""
    r = r_bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    q = tl.div_rn(x, tl.broadcast_to(r[:, None], x.shape))
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    # NOTE: 1.5 * 2^23 added and taken away rounds |q| < 2^22 to an integer, ties to even
    return ((q + 12582912.0) - 12582912.0).to(tl.int32)


@triton.jit
def signed_byte(b):
    """Int32 ``b`` in [0, 256) as the int8 of the same bits."""
    return tl.where(b > 127, b - 256, b).to(tl.int8)


@triton.jit
def store_kv_rows(dst, x, d, mask, row_mask, scale, head_dim, KV_QUANT: tl.constexpr, FP8_E4M3: tl.constexpr):
    """Store ``x`` ``[R, BLOCK_D]`` into the cache rows starting at ``dst`` (``[R, 1]`` pointers),
    quantized as ``KV_QUANT`` says. An fp8 cache comes as bytes (``FP8_E4M3``: e4m3fn, else
    e5m2; ``scale``: its per-tensor scale); an int8 row gets its float16 scale after its values."""
    if KV_QUANT == 0:
        tl.store(dst + d[None, :], x, mask=mask)
    elif KV_QUANT == 1:
        top: tl.constexpr = 448.0 if FP8_E4M3 else 57344.0
        v = tl.div_rn(x.to(tl.float32), tl.full(x.shape, scale, tl.float32))
        v = tl.clamp(v, -top, top, propagate_nan=tl.PropagateNan.ALL)
        tl.store(dst + d[None, :], fp8_bits(v, FP8_E4M3).to(tl.uint8), mask=mask)
    else:
        xf = tl.where(mask, x.to(tl.float32), 0.0)
        r_bits = int8_row_scale(xf)
        tl.store(dst + d[None, :], int8_values(xf, r_bits).to(tl.int8), mask=mask)
        tl.store(dst + head_dim, signed_byte(r_bits & 0xFF)[:, None], mask=row_mask[:, None])
        tl.store(dst + head_dim + 1, signed_byte(r_bits >> 8)[:, None], mask=row_mask[:, None])
