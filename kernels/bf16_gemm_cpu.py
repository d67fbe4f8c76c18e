"""A bfloat16 GEMM for CPUs with AVX-512-BF16 (kernels/bf16_gemm_cpu.c), for the linear layers.

At decode sizes (1-16 rows) a linear layer has to stream its weight at the memory's speed
while it multiplies. oneDNN's bfloat16 GEMM does at 1-4 rows; at 16 it reads the weight and
multiplies in turn (measured on a 2-core AVX-512-BF16 CPU, Qwen2.5-0.5B's gate/up weight
of 9728 x 896: 34 GB/s of a 47 GB/s read). The kernel here keeps its own weight layout and
prefetches the next tile of columns while it computes the current one (the C file says how),
which streams the same weight at 43 GB/s at 16 rows and matches oneDNN from 1 row to
prefill chunks of hundreds (``python -m benchmarks.cpu_linear --variants``).

::

    load:   weight [n, k] bf16 ──pack──► [n, k]-shaped tensor holding [n/16, k/2, 16, 2]
    call:   gemm(x [.., k], packed, bias) ──► Numba splits the 16-column blocks over the
            threads torch uses; each runs the C kernel on its blocks (no Python per block)

On a CPU with AVX2 and FMA but no AVX-512-BF16 the same layout runs through
kernels/bf16_gemm_avx2.c: each weight vector is widened to float32 in registers and
multiplied with FMA, x is widened once per call. oneDNN has no bfloat16 GEMM there at all
(it needs AVX-512 or AVX-NE-CONVERT), and torch's fallback reads a 9728 x 896 weight at
under 1 GB/s at 16 rows; :func:`isa` says which variant runs.

Float32 weights on a CPU with AVX2 and no AVX-512 go through kernels/f32_gemm_avx2.c (the
same threads and calls, its own layout ``[n/16, k, 16]``; :func:`f32_available`, :func:`pack_f32`,
:func:`gemm` on a float32 packed weight). There oneDNN's float32 GEMM read the 33.5M test
LLaMA's weights at 25-40% of the copy rate at 16 rows; this kernel ran its projections 1.2-2.5x
faster at 1-64 rows and 0.9-1.14x on 512-row prompt chunks (2 threads, AMD EPYC Zen 3), near the
FMA units' peak from 16 rows on. CPUs with AVX-512 keep oneDNN: no comparison was run there.

The C source is compiled on first use (kernels/_cpu_compile.py: the system's C compiler,
a cache directory keyed by the source's and flags' hash). :func:`available` is false, and
callers keep oneDNN or ``F.linear``, where the CPU has neither instruction set, no compiler
is found, Numba is missing, or ``PAGEDLLM_CPU_GEMM=0``. :func:`gemm_reference` is the oracle.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

try:
    import numba
    from numba import types
except ImportError:  # pragma: no cover - numba is a dependency; this keeps the package importable
    numba = None  # type: ignore[assignment]

from ._cpu_compile import AVX2_CFLAGS, AVX512_BF16_CFLAGS, build_library, cpu_has_avx512f, cpu_has_isa, load_symbol
from ._cpu_items import _use_threads
from ._cpu_memory import aligned_empty

__all__ = [
    "BLOCK",
    "ISAS",
    "available",
    "can_pack",
    "can_pack_f32",
    "f32_available",
    "gemm",
    "gemm_reference",
    "isa",
    "pack",
    "pack_f32",
    "unpack",
]

BLOCK = 16
"""Output columns per packed block: the weight's rows must be a multiple of it."""
SOURCE = Path(__file__).with_suffix(".c")
SYMBOL = "pagedllm_gemm_bf16"
PARALLEL_MIN_WORK = 1 << 17
"""Below this many multiply-adds a call runs on the calling thread: starting the pool costs
more than the product (Qwen2.5-0.5B's smallest projection at one row is 800K)."""
CFLAGS = AVX512_BF16_CFLAGS
ISAS = ("avx512-bf16", "avx2")
"""The kernel's variants, fastest first: (source, symbol, flags) in :data:`VARIANTS`."""
VARIANTS = {
    "avx512-bf16": (SOURCE, SYMBOL, CFLAGS),
    "avx2": (Path(__file__).with_name("bf16_gemm_avx2.c"), "pagedllm_gemm_bf16_avx2", AVX2_CFLAGS),
    "avx2-f32": (Path(__file__).with_name("f32_gemm_avx2.c"), "pagedllm_gemm_f32_avx2", AVX2_CFLAGS),
}


@functools.cache
def isa() -> str | None:
    """The variant :func:`gemm` runs here (one of :data:`ISAS`), or None: the first whose
    instructions the CPU has (with Numba and ``PAGEDLLM_CPU_GEMM`` not ``0``) and whose
    source a C compiler built."""
    return next((name for name in ISAS if runs(name)), None)


@functools.cache
def runs(variant: str) -> bool:
    """Whether ``variant`` can run on this CPU (AVX-512-BF16 CPUs run the AVX2 one too).

    NOTE: cached: :func:`gemm` asks on every call, and reading the CPU's flags takes ~100 us."""
    return cpu_has_isa(variant) and _library(variant) is not None


def available() -> bool:
    """Whether :func:`gemm` runs here (:func:`isa` is not None)."""
    return isa() is not None


@functools.cache
def f32_available() -> bool:
    """Whether float32 weights are packed for the float32 kernel here: AVX2 and FMA without AVX-512
    (where oneDNN's float32 GEMM is the slower one), Numba, a C compiler, ``PAGEDLLM_CPU_GEMM`` not ``0``."""
    return not cpu_has_avx512f() and runs("avx2-f32")


@functools.cache
def _library(variant: str = "avx512-bf16") -> Path | None:
    """The compiled variant's path (built now if not cached), loaded for Numba; None if it cannot be built."""
    source, _, flags = VARIANTS[variant]
    return build_library(source, flags)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` takes ``weight``: 2-D bfloat16 on the CPU, rows a multiple of
    :data:`BLOCK`, an even number of columns."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[0] % BLOCK == 0
        and weight.shape[1] % 2 == 0
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [n, k] in the kernel's layout, as a tensor of the same shape and dtype (64-byte aligned;
    a large one on huge pages: kernels/_cpu_memory.py).

    NOTE: its elements are not ``weight``'s at the same indices: only :func:`gemm` and
    :func:`unpack` may read it.
    """
    if not can_pack(weight):
        raise ValueError(
            f"the CPU bf16 GEMM packs 2-D bfloat16 CPU weights with rows a multiple of {BLOCK} and an even "
            f"number of columns, got {tuple(weight.shape)} {weight.dtype} on {weight.device}"
        )
    n, k = weight.shape
    tiles = weight.detach().reshape(n // BLOCK, BLOCK, k // 2, 2).permute(0, 2, 1, 3)
    out = aligned_empty(n * k, torch.bfloat16)
    out.view(n // BLOCK, k // 2, BLOCK, 2).copy_(tiles)
    return out.view(n, k)


def can_pack_f32(weight: torch.Tensor) -> bool:
    """Whether :func:`pack_f32` takes ``weight``: 2-D float32 on the CPU, rows a multiple of :data:`BLOCK`."""
    on_cpu = weight.device.type == "cpu" and weight.dtype == torch.float32
    return on_cpu and weight.dim() == 2 and weight.shape[0] % BLOCK == 0


def pack_f32(weight: torch.Tensor) -> torch.Tensor:
    """A float32 ``weight`` [n, k] in the float32 kernel's layout ``[n/16, k, 16]``, shaped [n, k] (as :func:`pack`)."""
    if not can_pack_f32(weight):
        raise ValueError(
            f"the CPU float32 GEMM packs 2-D float32 CPU weights with rows a multiple of {BLOCK}, "
            f"got {tuple(weight.shape)} {weight.dtype} on {weight.device}"
        )
    n, k = weight.shape
    out = aligned_empty(n * k, torch.float32)
    out.view(n // BLOCK, k, BLOCK).copy_(weight.detach().reshape(n // BLOCK, BLOCK, k).permute(0, 2, 1))
    return out.view(n, k)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The plain ``[n, k]`` weight that :func:`pack` (or :func:`pack_f32`) packed."""
    n, k = packed.shape
    if packed.dtype == torch.float32:
        return packed.reshape(n // BLOCK, k, BLOCK).permute(0, 2, 1).reshape(n, k)
    return packed.reshape(n // BLOCK, k // 2, BLOCK, 2).permute(0, 2, 1, 3).reshape(n, k)


def gemm(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, variant: str | None = None
) -> torch.Tensor:
    """``x @ w.T + bias`` for ``packed = pack(w)``, on as many threads as torch uses.

    x: [..., k] bfloat16; packed: [n, k]; bias: [n] bfloat16 or None -> [..., n] bfloat16.
    Sums are float32 (from the bias on), rounded to bfloat16 once. ``variant``: one of
    :data:`ISAS` that :func:`runs` here (default :func:`isa`). For ``packed = pack_f32(w)``
    everything is float32 and the float32 kernel runs (``variant`` ignored).
    """
    n, k = packed.shape
    dtype = packed.dtype
    name = str(dtype).removeprefix("torch.")
    if x.dtype != dtype or x.shape[-1] != k:
        raise ValueError(f"x must be {name} [..., {k}], got {x.dtype} {tuple(x.shape)}")
    if bias is not None and (bias.dtype != dtype or bias.shape != (n,)):
        raise ValueError(f"bias must be {name} [{n}], got {bias.dtype} {tuple(bias.shape)}")
    if dtype == torch.float32:
        variant = "avx2-f32"
    else:
        variant = variant or isa()
    if variant is None or not runs(variant):
        raise ValueError(f"the CPU GEMM variant {variant!r} does not run on this CPU; it runs {isa()!r}")
    rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=dtype)
    if m > 0 and n > 0:
        # NOTE: the AVX2 bf16 variant multiplies float32 inputs: widened here once, not per weight vector
        xs = rows.float() if variant == "avx2" else rows
        blocks = n // BLOCK
        threads = min(_use_threads(torch.get_num_threads()), blocks) if m * n * k >= PARALLEL_MIN_WORK else 1
        bias_addr = 0 if bias is None else bias.contiguous().data_ptr()
        args = (xs.data_ptr(), m, k, packed.data_ptr(), bias_addr, n, blocks, out.data_ptr())
        if threads > 1:
            _parallel(variant)(*args, threads)
        else:
            _serial(variant)(*args)
    return out if rows is x else out.view(*x.shape[:-1], n)


def _external(variant: str):
    _library(variant)
    i64, ptr = types.int64, types.intp
    return types.ExternalFunction(VARIANTS[variant][1], types.void(ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr))


@functools.cache
def _serial(variant: str):
    """The C function called on the calling thread, through ctypes (no Numba region to start)."""
    path = _library(variant)
    assert path is not None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = load_symbol(path, VARIANTS[variant][1], (ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr))

    def call(x, m, k, w, bias, n, blocks, y):
        fn(x, m, k, w, bias or None, n, 0, blocks, y)

    return call


@functools.cache
def _parallel(variant: str):
    """A Numba function that deals the column blocks out over ``parts`` threads, an even share each."""
    kernel = _external(variant)

    def run(x, m, k, w, bias, n, blocks, y, parts):
        for t in numba.prange(parts):
            kernel(x, m, k, w, bias, n, blocks * t // parts, blocks * (t + 1) // parts, y)

    return numba.njit(parallel=True, nogil=True, cache=False)(run)


def gemm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: ``x @ weight.T + bias`` (plain ``weight``) in float64, rounded to bfloat16 once."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(torch.bfloat16)
