"""8-bit KV cache formats: what a quantized cache holds, and the torch quantize/dequantize twins.

A cache's dtype says which format it holds, so every op can tell from the tensor alone::

    float8_e4m3fn  [num_blocks, block_size, num_kv_heads, head_dim]      x ~ fp8(x / s) * s
    float8_e5m2    [num_blocks, block_size, num_kv_heads, head_dim]      x ~ fp8(x / s) * s
    int8           [num_blocks, block_size, num_kv_heads, head_dim + 2]  x ~ q * r
                    one (token, head) row:  q_0 .. q_{d-1} | r (float16, 2 bytes, little-endian)

FP8 uses one scale ``s`` per layer and per K / V (vLLM's and the checkpoints' convention:
compressed-tensors / ModelOpt ship ``k_scale`` / ``v_scale``; 1.0 otherwise). e4m3 keeps 3
mantissa bits (relative error <= 2^-4) over +-448, e5m2 2 bits over +-57344: e4m3 is the
accurate one, e5m2 the one that cannot overflow at scale 1.0. Both decode exactly from
their byte with a shift (see the CPU kernel), so reading them costs next to nothing.

INT8 with a static per-tensor scale loses the rows whose magnitude is far below the
tensor's maximum (keys' outlier channels set the range); a scale per (token, head) row,
``r = max|x| / 127``, keeps a relative error of about 2^-8 of the row's own maximum, better
than e4m3 on every row. The scale rides inside the row itself, so every block-level
operation (copy-on-write copies, swaps to the host, prefix-cache reuse, tensor-parallel
shards) moves scales with their values and needs no change. It is a float16: two bytes
instead of a float32's four keep the 64-wide heads of small models at 66 bytes a row
(1.94x the rows of a 16-bit cache at equal memory, where four bytes would give 1.88x); its
rounding (2^-11) is well under int8's own. The scale is rounded up before use, so ``|q|``
never exceeds 127.

Quantization happens once, when a token's K/V is written (one pass: kv_write_cpu.py on the
CPU, reshape_and_cache.py's Triton kernel on CUDA, both bit for bit :func:`quantize` run on the
CPU); attention kernels read the 8-bit values and widen them as they go, so a step reads
half the bytes of a 16-bit cache.
On the CPU every format widens exactly in a few instructions (kernels/_cpu_widen.py for the
Numba paths; the C decode item and prefill kernel widen K to bfloat16 pairs and V to float32),
and int8's row scale costs one multiply per row. The C decode item at the Qwen2.5-0.5B shape
(batch 16, contexts ~200, 2 threads, kernels/decode_scores_cpu.py) took about 0.16 ms a call
over a bfloat16 cache, 0.10 over int8 and 0.13 over e4m3: reading half the bytes shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANT_DTYPES = (*FP8_DTYPES, torch.int8)
"""Cache dtypes that hold quantized values (widened to float32 as they are read)."""
INT8_SCALE_BYTES = 2
"""Bytes of the float16 scale that ends every int8 row."""
_INT8_MAX = 127.0

C_FORMAT_NAMES = {
    torch.bfloat16: "bf16",
    torch.int8: "int8",
    torch.float8_e4m3fn: "e4m3",
    torch.float8_e5m2: "e5m2",
}
"""The cache dtypes the C attention kernels read under a bfloat16 query (the formats of
kernels/_cpu_attention.h), by the name that ends each exported copy's symbol."""

CACHE_DTYPE_OF = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
"""The cache dtype of each quantized ``kv_cache_dtype`` setting."""


@dataclass(frozen=True)
class KVScales:
    """Per-tensor scales of one layer's FP8 K and V caches (unused by int8, whose rows carry their own)."""

    k_scale: float = 1.0
    v_scale: float = 1.0


UNIT_SCALES = KVScales()


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor dtype of a ``kv_cache_dtype`` setting (``auto``: the model's)."""
    return model_dtype if kv_cache_dtype == "auto" else CACHE_DTYPE_OF[kv_cache_dtype]


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of one (token, head) row in a cache of ``dtype``: int8 rows end with their scale."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QUANT_DTYPES


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size a cache holds (its last dim, less an int8 row's scale bytes)."""
    return cache.shape[-1] - (INT8_SCALE_BYTES if cache.dtype == torch.int8 else 0)


def raw(cache: torch.Tensor) -> torch.Tensor:
    """A view that indexing ops take: torch's CPU kernels do not copy float8 tensors, bytes they do."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` as cache rows of ``dtype`` (unchanged if not a quantized dtype)."""
    if dtype in FP8_DTYPES:
        top = torch.finfo(dtype).max
        return (x.float() / scale).clamp(-top, top).to(dtype)
    if dtype != torch.int8:
        return x.to(dtype)
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    r = (amax / _INT8_MAX).clamp(min=2.0**-24).half()
    # NOTE: rounded up where float16 rounded it down, so |q| <= 127 (full_like: no host copy, graph-safe)
    r = torch.where(r.float() * _INT8_MAX < amax, r.nextafter(torch.full_like(r, 65504.0)), r)
    q = (x / r.float()).round().clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return torch.cat([q, r.view(torch.int8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Cache rows ``[..., row]`` back to ``[..., head_dim]`` values in ``dtype``."""
    if rows.dtype in FP8_DTYPES:
        return (rows.float() * scale).to(dtype)
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    q, r = rows[..., :-INT8_SCALE_BYTES], rows[..., -INT8_SCALE_BYTES:].contiguous().view(torch.float16)
    return (q.float() * r.float()).to(dtype)


def write_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float = 1.0) -> None:
    """``cache`` flattened to slots gets ``x`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slots`` (all >= 0)."""
    rows = quantize(x, cache.dtype, scale)
    raw(cache).view(-1, *cache.shape[2:]).index_copy_(0, slots, raw(rows))
