"""Reading one tile of a paged K or V cache inside a Triton kernel, whatever the cache holds.

The attention kernels call :func:`load_kv_tile` where they would ``tl.load`` a tile; it
widens an 8-bit cache (kernels/kv_quant.py) to the query's dtype, so ``tl.dot`` runs as
it does on a 16-bit cache::

    KV_PLAIN  the model's dtype: loaded as is
    KV_FP8    float8 e4m3 / e5m2: widened, times the layer's per-tensor scale
    KV_INT8   int8 values, times the row's float16 scale (the row's last 2 bytes)
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
