"""What the elementwise CPU kernels (Numba) share: how each is compiled and launched, and
float32 and bfloat16 elements inside them, one kernel source for both.

:func:`compile_kernel` builds a kernel on one thread or spread over Numba's pool;
:func:`launch` picks the build for a call's size (see ``PARALLEL_MIN_ELEMENTS``). A kernel
called at decode sizes may take its tensors by address (``tensor.data_ptr()``, viewed in the
kernel with ``numba.carray(address_as(address, like), shape)``, ``like`` from
:func:`dtype_token`): a tensor's NumPy array costs about a microsecond a call.

NumPy has no bfloat16, so a bfloat16 tensor reaches a kernel as its bit patterns
(``tensor.view(torch.uint16).numpy()``, see :func:`kernel_array`). Torch's CPU ops on
bfloat16 widen their inputs to float32, compute in float32 and round each op's result to
bfloat16 (round to nearest, ties to even); a kernel that does what a chain of torch ops
does therefore rounds after every op. The three helpers below pick, by the type of the
array they are given, what that means when the kernel is compiled::

                          float32 array        uint16 array (bfloat16 bits)
    load(elem)            elem                 float32 bits = bits << 16          (exact)
    round_like(v, arr)    v                    v rounded to bfloat16, as float32
    store_like(v, arr)    v                    bits of v rounded to bfloat16

so the float32 kernel compiles to exactly what it would without them. Rounding is
torch's (c10's ``round_to_nearest_even``): ``(bits + 0x7FFF + ((bits >> 16) & 1)) >> 16``,
and any NaN becomes the quiet NaN ``0x7FC0``.

NOTE: the decode kernel (kernels/paged_decode_attention_cpu.py) inlines ``load`` and ``store_like``,
and Numba's disk cache keys it on its own file: an edit to them must also touch that file.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from pathlib import Path
from types import FunctionType

import numpy as np
import torch

from ._cpu_items import HAS_NUMBA, _use_threads

if HAS_NUMBA:
    import numba
    from llvmlite import ir
    from numba.extending import intrinsic

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes these kernels compute in; others take the torch references."""
_DTYPE_TOKENS: dict[torch.dtype, np.ndarray] = {
    torch.float32: np.empty((0,), np.float32),
    torch.bfloat16: np.empty((0,), np.uint16),
}


def kernel_array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as the array a kernel takes: float32 as it is, bfloat16 as its uint16 bits."""
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


def dtype_token(dtype: torch.dtype) -> np.ndarray:
    """An empty array of the kernel dtype for ``dtype``: what a kernel that takes tensors by
    address (``address_as``) is compiled for, float32 or bfloat16 bits."""
    return _DTYPE_TOKENS[dtype]


def flat_rows(t: torch.Tensor) -> tuple[np.ndarray, int]:
    """A [rows, cols] tensor as a flat kernel array from its first element to its last, and its
    row stride: a kernel indexing row r at ``r * stride`` reads unit-stride 1-D slices, which
    vectorise, where a strided 2-D view's (a column slice of a fused projection's output) do not.

    NOTE: the same memory, so a kernel may write ``t`` through it, unless ``t``'s columns are
    strided: then it is a contiguous copy.
    """
    if t.is_contiguous():
        return kernel_array(t).reshape(-1), t.shape[1]
    if t.stride(1) != 1 and t.shape[1] > 1:
        t = t.contiguous()
    stride = t.stride(0)
    return kernel_array(t.as_strided(((t.shape[0] - 1) * stride + t.shape[1],), (1,))), stride


def compile_kernel(kernel: Callable, parallel: bool, **options) -> Callable:
    """``kernel`` compiled by Numba, on one thread or spreading its ``prange`` over Numba's
    pool, its machine code cached on disk where a cache directory is writable.

    NOTE: NumPy's error model: a float division by zero gives inf or NaN as in torch, not
    Python's ZeroDivisionError, whose test in every iteration would keep loops from vectorising.
    """
    kernel = _cache_name(kernel, parallel)
    options |= {"parallel": parallel, "boundscheck": False, "error_model": "numpy"}
    try:
        return numba.njit(cache=True, **options)(kernel)
    except RuntimeError:  # numba: no writable cache directory
        return numba.njit(cache=False, **options)(kernel)


def _cache_name(kernel: Callable, parallel: bool) -> Callable:
    """A copy of ``kernel`` named for its build and for this module's source.

    NOTE: Numba's disk cache knows a function by its name, its bytecode and the time stamp
    of its own file: not by the options it was compiled with, nor by the helpers it inlines
    from here. The name keeps the serial and parallel builds apart and changes with this
    file, so that no build ever loads machine code compiled from other source.
    """
    return renamed_copy(kernel, f"{kernel.__name__}_{'parallel' if parallel else 'serial'}_{_source_digest()}")


def renamed_copy(fn: Callable, name: str, names: dict | None = None) -> Callable:
    """``fn`` named ``name``, its globals those of its module with ``names`` in place of theirs."""
    copy = FunctionType(fn.__code__, fn.__globals__ | (names or {}), name, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = name
    return copy


@functools.cache
def _source_digest() -> str:
    """Of this module and of the ``exp`` the kernels inline from ``_fast_exp.py``."""
    here = Path(__file__)
    return hashlib.sha256(here.read_bytes() + here.with_name("_fast_exp.py").read_bytes()).hexdigest()[:12]


def _narrow_ir(builder, value):
    """LLVM IR: float32 ``value`` rounded to nearest-even bfloat16, as its 32-bit pattern (low half zero)."""
    i32 = ir.IntType(32)
    bits = builder.bitcast(value, i32)
    odd = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
    rounded = builder.add(bits, builder.add(odd, ir.Constant(i32, 0x7FFF)))
    rounded = builder.and_(rounded, ir.Constant(i32, 0xFFFF0000))
    is_nan = builder.fcmp_unordered("uno", value, value)
    return builder.select(is_nan, ir.Constant(i32, 0x7FC00000), rounded)


def _is_bf16(array) -> bool:
    return isinstance(array, numba.types.Array) and array.dtype == numba.types.uint16


def _load(typingctx, elem):
    types = numba.types
    if elem == types.float32:
        return types.float32(elem), lambda context, builder, signature, args: args[0]
    if elem == types.uint16:

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            return builder.bitcast(builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16)), ir.FloatType())

        return types.float32(elem), codegen
    return None


def _like(value, array, result, codegen):
    """An intrinsic's typing for a float32 ``value`` put in ``array``'s dtype: ``codegen`` where
    ``array`` holds bfloat16 bits, the value as it is where it holds float32."""
    types = numba.types
    if value != types.float32:
        return None
    if not _is_bf16(array):
        return types.float32(value, array), lambda context, builder, signature, args: args[0]
    return result(value, array), codegen


def _round_like(typingctx, value, array):
    def codegen(context, builder, signature, args):
        return builder.bitcast(_narrow_ir(builder, args[0]), ir.FloatType())

    return _like(value, array, numba.types.float32, codegen)


def _store_like(typingctx, value, array):
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        return builder.trunc(builder.lshr(_narrow_ir(builder, args[0]), ir.Constant(i32, 16)), ir.IntType(16))

    return _like(value, array, numba.types.uint16, codegen)


def _address_as(typingctx, address, like):
    """A pointer to elements of ``like``'s dtype at ``address`` (an integer, ``tensor.data_ptr()``)."""
    types = numba.types
    if not isinstance(like, types.Array) or not isinstance(address, types.Integer):
        return None
    pointer = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(address, like), codegen


if HAS_NUMBA:
    address_as: Callable = intrinsic(_address_as)
    load: Callable = intrinsic(_load)
    round_like: Callable = intrinsic(_round_like)
    store_like: Callable = intrinsic(_store_like)


# NOTE: below this many elements a kernel runs on the calling thread. Two threads pay from
# about 16384 elements on a quiet machine (RMSNorm on [16, 512]: 2.2 µs on one thread, 2.7 on
# two; on [64, 512]: 7.0 and 5.2), but a parallel kernel waits for its slowest thread: where
# another process holds a core, a call stalls for a scheduler time slice (milliseconds, seen
# on a shared machine). Decode batches (up to [64, 512]) therefore stay on one thread, and
# prefill chunks, where halving a call's time is worth the risk, spread.
PARALLEL_MIN_ELEMENTS = 65536


def launch(compiled: Callable[[bool], Callable], elements: int) -> Callable:
    """The build of a kernel for ``elements``: ``compiled(True)`` spreads it over torch's thread
    count in Numba's pool, ``compiled(False)`` runs it on the calling thread."""
    threads = torch.get_num_threads()
    if elements < PARALLEL_MIN_ELEMENTS or threads == 1:
        return compiled(False)
    _use_threads(threads)
    return compiled(True)
