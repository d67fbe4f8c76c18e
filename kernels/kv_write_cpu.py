"""The step's new K/V quantized and written into an 8-bit cache in one compiled CPU pass (Numba).

:func:`~pagedllm.kernels.kv_quant.quantize` is a chain of small torch ops (abs, amax, divide,
clamp, float16, nextafter, round, cat...), run for K and again for V in every layer: most of
its time is per-op overhead on the few rows a decode step writes. Here one loop per
(token, head) row does all of it and stores the bytes straight into the row's slot::

    slot = slots[t]  (< 0: padding, skipped)
    int8:   r = half(max(max|x| / 127, 2^-24)), one float16 step up if r * 127 < max|x|
            cache[slot, h] = round(x / r) clamped to +-127 | r's two bytes (little-endian)
    fp8:    cache[slot, h] = fp8(clamp(x / scale, +-max))   (e4m3fn or e5m2, per-tensor scale)

Bit for bit what :func:`write_kv_quantized_reference` (the torch ops) stores: every step is
one float32 operation rounded as torch rounds it (division, not a reciprocal; ties to even
in ``round``, in float16 and in fp8, the conversions written out as c10 writes them), and
no fast-math. Float32 and bfloat16 inputs; others take the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from ._numba_cpu import KERNEL_DTYPES, compile_kernel, kernel_array, launch
from .kv_quant import raw, write_rows
from .paged_decode_attention_cpu import HAS_NUMBA

if HAS_NUMBA:
    import numba
    from llvmlite import ir
    from numba.extending import intrinsic

    from ._numba_cpu import load

_FORMATS = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
"""The kernel's code for each cache dtype it writes."""


def write_kv_quantized_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, row] 8-bit
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, row] 8-bit
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0: padding
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """``key``/``value`` quantized by the torch ops of ``kv_quant.quantize`` into their slots (in place)."""
    valid = slot_mapping >= 0
    write_rows(key_cache, slot_mapping[valid], key[valid], k_scale)
    write_rows(value_cache, slot_mapping[valid], value[valid], v_scale)


def _bits_of(typingctx, value):
    """A float32's bit pattern as an int64 (zero-extended)."""
    if value != numba.types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return numba.types.int64(value), codegen


def _float_of(typingctx, bits):
    """The float32 of a bit pattern (the low 32 bits of an int64)."""
    if bits != numba.types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())

    return numba.types.float32(bits), codegen


if HAS_NUMBA:
    bits_of: Callable = intrinsic(_bits_of)
    float_of: Callable = intrinsic(_float_of)


def _device(fn):
    """A helper the kernel inlines (exact IEEE arithmetic: no fast-math)."""
    return numba.njit(inline="always", boundscheck=False, error_model="numpy")(fn) if HAS_NUMBA else fn


@_device
def _half_bits(v):  # pragma: no cover - compiled
    """A float32 >= 0 (or NaN) rounded to nearest-even float16, as its bits (torch's ``.half()``)."""
    u = bits_of(v)
    if u > 0x7F800000:
        return 0x7E00
    if u >= 0x477FF000:  # 65520 and up round to inf
        return 0x7C00
    if u < 0x38800000:  # below 2^-14: a float16 subnormal; adding 0.5 rounds to its 2^-24 steps
        return bits_of(v + np.float32(0.5)) - 0x3F000000
    return (u - (112 << 23) + 0xFFF + ((u >> 13) & 1)) >> 13


@_device
def _half_value(h):  # pragma: no cover - compiled
    """The float32 of a non-negative float16's bits."""
    if h >= 0x7C00:
        return float_of(0x7F800000 if h == 0x7C00 else 0x7FC00000)
    if h < 0x400:
        return np.float32(h) * np.float32(2.0**-24)
    return float_of((h << 13) + (112 << 23))


@_device
def _fp8_bits(v, e4m3):  # pragma: no cover - compiled
    """A float32 as fp8 e4m3fn or e5m2 bits, rounded to nearest-even (c10's conversions)."""
    u = bits_of(v)
    sign = (u >> 24) & 0x80
    u &= 0x7FFFFFFF
    if e4m3:
        if u >= 1087 << 20:  # 480 and up (or NaN): NaN
            return 0x7F | sign
        if u < 121 << 23:  # below 2^-6: subnormal, rounded by adding 2^-(6 - 3 - 1 - 127 + 141)
            return (bits_of(float_of(u) + float_of(141 << 23)) - (141 << 23)) | sign
        return ((u - (120 << 23) + 0x7FFFF + ((u >> 20) & 1)) >> 20) | sign
    if u >= 143 << 23:  # 2^16 and up: inf (NaN stays NaN)
        return (0x7F if u > 0x7F800000 else 0x7C) | sign
    if u < 113 << 23:  # below 2^-14: subnormal
        return (bits_of(float_of(u) + float_of(134 << 23)) - (134 << 23)) | sign
    return ((u - (112 << 23) + 0xFFFFF + ((u >> 21) & 1)) >> 21) | sign


@_device
def _write_int8_row(x, row):  # pragma: no cover - compiled
    dim = x.shape[0]
    amax = np.float32(0.0)
    for i in range(dim):
        amax = max(amax, abs(load(x[i])))
    r_bits = _half_bits(max(amax / np.float32(127.0), np.float32(2.0**-24)))
    if _half_value(r_bits) * np.float32(127.0) < amax and r_bits < 0x7BFF:
        r_bits += 1  # rounded up where float16 rounded it down: |q| <= 127
    r = _half_value(r_bits)
    for i in range(dim):
        q = min(max(np.rint(load(x[i]) / r), np.float32(-127.0)), np.float32(127.0))
        row[i] = np.int8(q)
    lo, hi = r_bits & 0xFF, r_bits >> 8  # the float16's bytes, little-endian, as int8
    row[dim] = lo - 256 if lo > 127 else lo
    row[dim + 1] = hi - 256 if hi > 127 else hi


@_device
def _write_fp8_row(x, row, scale, top, e4m3):  # pragma: no cover - compiled
    for i in range(x.shape[0]):
        v = min(max(load(x[i]) / scale, -top), top)
        row[i] = np.uint8(_fp8_bits(v, e4m3))


def _kernel(key, value, key_rows, value_rows, slots, k_scale, v_scale, fmt):  # pragma: no cover - compiled
    # key, value: [tokens, heads, head_dim] float32 or bfloat16 bits; *_rows: [slots, heads, row] int8 or uint8
    tokens, heads = key.shape[0], key.shape[1]
    top = np.float32(448.0 if fmt == 1 else 57344.0)
    for t in numba.prange(tokens):
        slot = slots[t]
        if slot < 0:
            continue
        for h in range(heads):
            if fmt == 0:
                _write_int8_row(key[t, h], key_rows[slot, h])
                _write_int8_row(value[t, h], value_rows[slot, h])
            else:
                _write_fp8_row(key[t, h], key_rows[slot, h], k_scale, top, fmt == 1)
                _write_fp8_row(value[t, h], value_rows[slot, h], v_scale, top, fmt == 1)


@functools.cache
def _compiled(parallel: bool):
    return compile_kernel(_kernel, parallel)


def write_kv_quantized_cpu(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, row] 8-bit
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, row] 8-bit
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0: padding
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """:func:`write_kv_quantized_reference` in one compiled pass for float32 or bfloat16 CPU
    K/V (head_dim contiguous; strided tokens and heads are fine); the reference otherwise."""
    if not _fits_kernel(key, value, key_cache, value_cache, slot_mapping):
        write_kv_quantized_reference(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    if key.shape[0] == 0:
        return
    launch(_compiled, key.numel())(
        kernel_array(key),
        kernel_array(value),
        raw(key_cache).view(-1, *key_cache.shape[2:]).numpy(),
        raw(value_cache).view(-1, *value_cache.shape[2:]).numpy(),
        slot_mapping.numpy(),
        np.float32(k_scale),
        np.float32(v_scale),
        _FORMATS[key_cache.dtype],
    )


def _fits_kernel(key, value, key_cache, value_cache, slot_mapping) -> bool:
    if not HAS_NUMBA or key.dtype not in KERNEL_DTYPES or value.dtype != key.dtype:
        return False
    if key_cache.dtype not in _FORMATS or value_cache.dtype != key_cache.dtype:
        return False
    tensors = (key, value, key_cache, value_cache, slot_mapping)
    if any(t.device.type != "cpu" for t in tensors) or slot_mapping.dtype != torch.int64:
        return False
    if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
        return False
    return key.dim() == 3 and key.stride(-1) == 1 and value.stride(-1) == 1 and key_cache.is_contiguous()
