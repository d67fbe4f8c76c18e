"""``exp`` in float32 operations only, so that a compiled loop of it vectorises (Numba, CPU).

NumPy's and Numba's ``np.exp`` call the C library's scalar ``expf`` once per element. This
is a polynomial (Cephes' ``expf``, as in SSE/AVX "mathfun"), ``exp(x) = 2^n * e^r`` with
``r = x - n ln 2``, which LLVM vectorises. It differs from torch's (SLEEF's) and the C
library's in the last bit now and then (within a few ulp); infinities and NaN come out as
theirs. Kernels inline :data:`exp` (``_exp_f32`` is the same in plain Python).

NOTE: Numba's disk cache keys a kernel on its own file. The elementwise kernels' cache
names include a digest of this file (``_numba_cpu._source_digest``); the decode attention
kernel's do not, so an edit here must also touch ``paged_decode_attention_cpu.py``.
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


def _pow2(typingctx, n):
    """``2 ** n`` for a whole float32 ``n`` in [-126, 127], built from its exponent bits."""
    if n != numba.types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        biased = builder.add(builder.fptosi(args[0], i32), ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(biased, ir.Constant(i32, 23)), ir.FloatType())

    return numba.types.float32(n), codegen


def _pow2_python(n):
    return np.float32(2.0) ** n


pow2: Callable = intrinsic(_pow2) if numba is not None else _pow2_python


_F = np.float32
_ONE, _HALF, _TWO = _F(1.0), _F(0.5), _F(2.0)
_EXP_MAX, _EXP_MIN = _F(88.72284), _F(-87.0)
_LOG2E, _LN2_HI, _LN2_LO = _F(1.442695), _F(0.693359375), _F(-2.12194440e-4)
_P0, _P1, _P2 = _F(1.9875691500e-4), _F(1.3981999507e-3), _F(8.3334519073e-3)
_P3, _P4, _P5 = _F(4.1665795894e-2), _F(1.6666665459e-1), _F(5.0000001201e-1)


def _exp_f32(x):  # pragma: no cover - compiled
    """``exp`` of a float32 in float32 operations only, so that a loop of it vectorises."""
    big = x > _EXP_MAX
    # NOTE: below -87 the result is exp(-87), under 2e-38: as good as 0 next to 1 (SiLU's 1 + exp,
    # a softmax whose largest term is 1)
    x = min(max(x, _EXP_MIN), _EXP_MAX)
    n = np.floor(x * _LOG2E + _HALF)
    r = x - n * _LN2_HI - n * _LN2_LO  # x - n ln 2, in two parts to keep r's bits
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    # NOTE: 2^n as 2^(n-1) * 2, as n reaches 128 where exp(x) is still below the float32 maximum
    y = (p * (r * r) + r + _ONE) * pow2(n - _ONE) * _TWO
    return np.float32(np.inf) if big else y


exp: Callable = (
    numba.njit(inline="always", fastmath=False, boundscheck=False)(_exp_f32) if numba is not None else _exp_f32
)
