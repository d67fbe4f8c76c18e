"""How the compiled CPU decode kernel widens one cache element to float32, per cache format.

NumPy has no bfloat16 or float8 and Numba no float16 on the CPU, so 16- and 8-bit caches
reach the kernel as integer bit patterns, and each element is widened as it is read.
Every conversion is exact and a few instructions (no table, no branch)::

    float32                       as it is
    bfloat16  (viewed as uint16)  float32 bits = bits << 16
    float16   (viewed as int16)   LLVM's fpext half -> float (vcvtph2ps)
    int8      (int8)              sitofp; times the row's float16 scale (kernels/kv_quant.py)
    fp8 e5m2  (uint8)             the high byte of a float16: fpext(half(bits << 8))
    fp8 e4m3  (uint8)             sign to bit 15, exponent and mantissa to bits 7..13 of a
                                  float16: fpext gives the value / 2^8 (subnormals included),
                                  and the kernel folds 2^8 into the score or output scale

(e4m3's all-ones pattern, NaN, reads as 480: the cache never stores it, see kv_quant.quantize.)
:data:`widen` picks the 16-bit and int8 conversions by the element's type; the two fp8
formats share uint8, so the kernel is specialised with :data:`widen_e4m3` or
:data:`widen_e5m2` in its place.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

try:
    import numba
    from llvmlite import ir
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - numba is a dependency; this keeps the package importable
    numba = None  # type: ignore[assignment]

HAS_NUMBA = numba is not None
E4M3_FACTOR = 256.0
"""What :data:`widen_e4m3`'s result is to be multiplied by (folded into a scale by the caller)."""


def _llvm_widen(typingctx, value):
    """float32 as it is, bfloat16 bits (uint16) shifted into the high half of a float32,
    float16 bits (int16) converted by ``fpext``, int8 by ``sitofp``: chosen by the type."""
    types, i32 = numba.types, ir.IntType(32)
    if value == types.float32:

        def codegen(context, builder, signature, args):
            return args[0]

    elif value == types.uint16:

        def codegen(context, builder, signature, args):
            bits = builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16))
            return builder.bitcast(bits, ir.FloatType())

    elif value == types.int16:

        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    elif value == types.int8:

        def codegen(context, builder, signature, args):
            return builder.sitofp(args[0], ir.FloatType())

    else:
        return None
    return types.float32(value), codegen


def _llvm_fp8(e4m3: bool):
    """An intrinsic widening fp8 bits (uint8) through a float16 (see the module's table)."""

    def typer(typingctx, value):
        if value != numba.types.uint8:
            return None
        i16 = ir.IntType(16)

        def codegen(context, builder, signature, args):
            bits = builder.zext(args[0], i16)
            if e4m3:
                sign = builder.shl(builder.and_(bits, ir.Constant(i16, 0x80)), ir.Constant(i16, 8))
                body = builder.shl(builder.and_(bits, ir.Constant(i16, 0x7F)), ir.Constant(i16, 7))
                bits = builder.or_(sign, body)
            else:
                bits = builder.shl(bits, ir.Constant(i16, 8))
            return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())

        return numba.types.float32(value), codegen

    return typer


def _widen_python(value):
    """What :func:`_llvm_widen` computes, for the kernel run as Python without numba."""
    if value.dtype == np.uint16:
        return (np.uint32(value) << np.uint32(16)).view(np.float32)
    if value.dtype == np.int16:
        return np.float32(value.view(np.float16))
    return np.float32(value)


def _e4m3_python(value):
    bits = ((int(value) & 0x80) << 8) | ((int(value) & 0x7F) << 7)
    return np.float32(np.uint16(bits).view(np.float16))


def _e5m2_python(value):
    return np.float32(np.uint16(int(value) << 8).view(np.float16))


widen: Callable = intrinsic(_llvm_widen) if HAS_NUMBA else _widen_python
widen_e4m3: Callable = intrinsic(_llvm_fp8(True)) if HAS_NUMBA else _e4m3_python
widen_e5m2: Callable = intrinsic(_llvm_fp8(False)) if HAS_NUMBA else _e5m2_python
