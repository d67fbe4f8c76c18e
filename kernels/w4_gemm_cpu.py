"""A 4-bit weight-only GEMM (W4A16) for CPUs with AVX-512-BF16 (kernels/w4_gemm_cpu.c) or AVX2, for quantized linears.

The sibling of bf16_gemm_cpu.py for AWQ / GPTQ / compressed-tensors 4-bit weights with zero
points: the same tiles of 64 columns, rows four at a time, the next tile prefetched into L2,
but each weight pair read as one byte and widened in registers (the C file says how), so a
decode step reads a quarter of bfloat16's bytes and never writes a widened weight back.

::

    load:   q [n, k] levels, scales / zeros [n, k / group] ──pack──► W4Packed: weight
            [n/16, k/2, 16] uint8, meta [n/16, k/group, 2, 16] float32 (scale, 128 + zero)
    call:   gemm(x [.., k], packed) ──► Numba splits the 16-column blocks over the threads torch
            uses; each runs the C kernel on its blocks, which sums x's groups first (xsum
            [rows, k/group] float32; from torch, handed in, past LOCAL_SUMS of them)

Where the CPU also has AVX-512-VNNI and VBMI, :func:`gemm_int8` runs the same packed weight against
x quantized to int8 per row and group (W4A8, the C file says how): VPDPBUSD multiplies twice the
pairs per instruction of VDPBF16PS, and three operations widen 64 levels where they widened 32 into
bfloat16 pairs, so a call bound by its multiply-adds (from a few rows on) takes about half the time.
Qwen2.5-0.5B's gate/up (9728 x 896, group 128) on one thread of an AVX-512 EPYC:
0.33 / 1.25 ms at 16 / 64 rows against :func:`gemm`'s 0.61 / 2.3, 0.08 ms against 0.11 at one row.
The cost is x's rounding to 8 bits, about 0.7% of a product's size for normally distributed x
(:func:`gemm` rounds only its result to bfloat16). 8-bit weights (:func:`pack8`) run on the same
product, their levels laid out so that VPDPBUSD takes them as they are.

With AVX2 and FMA but no AVX-512-BF16, kernels/w4_gemm_avx2.c runs both products: :func:`gemm` on the
same packing, converting levels to float32 in registers (FMA), and :func:`gemm_int8` on VPMADDUBSW with
16-bit partial sums, on a packing of its own (:func:`pack_spans`, the same bytes in another order:
:func:`int8_pack` packs for the variant that runs; the C file says why). Built as bf16_gemm_cpu's kernel
is (kernels/_cpu_compile.py): :func:`isa` and :func:`int8_isa` name the variants that run (None: no
compiler or Numba, neither ISA, ``PAGEDLLM_CPU_GEMM=0``; ``PAGEDLLM_W4A8=0`` for the int8 one).
Oracles: kernels/w4_gemm_reference.py.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

try:
    import numba
    from numba import types
except ImportError:  # pragma: no cover - numba is a dependency; this keeps the package importable
    numba = None  # type: ignore[assignment]

from ._cpu_compile import (
    AVX2_CFLAGS,
    AVX512_BF16_CFLAGS,
    build_library,
    cpu_has_flags,
    cpu_has_isa,
    load_symbol,
)
from ._cpu_items import _use_threads
from ._cpu_memory import thread_scratch
from .w4_gemm_reference import w4_gemm_reference, w4a8_reference
from .w4_pack import BLOCK, W4Packed, can_pack, pack, pack8, pack_spans, unpack

__all__ = [
    "BLOCK",
    "ISAS",
    "Int8Product",
    "W4Packed",
    "available",
    "can_pack",
    "gemm",
    "gemm_int8",
    "int8_available",
    "int8_isa",
    "int8_pack",
    "int8_runs",
    "isa",
    "pack",
    "pack8",
    "pack_spans",
    "quantize_rows",
    "runs",
    "unpack",
    "w4_gemm_reference",
    "w4a8_reference",
    "w8_available",
]

SOURCE = Path(__file__).with_suffix(".c")
SYMBOL = "pagedllm_gemm_w4"
ISAS = ("avx512-bf16", "avx2")
""":func:`gemm`'s variants, fastest first: (source, symbol, flags) in :data:`VARIANTS`."""
VARIANTS = {
    "avx512-bf16": (SOURCE, SYMBOL, AVX512_BF16_CFLAGS),
    "avx2": (Path(__file__).with_name("w4_gemm_avx2.c"), "pagedllm_gemm_w4_avx2", AVX2_CFLAGS),
}
PARALLEL_MIN_WORK = 1 << 18
"""Below this many multiply-adds a call runs on the calling thread: starting the pool costs more than the product."""
INT8_SYMBOL = "pagedllm_gemm_w4a8"
W8_SYMBOL = "pagedllm_gemm_w8a8"
QUANTIZE_SYMBOL = "pagedllm_quantize_s8"
INT8_VARIANTS = {
    "avx512-bf16": (QUANTIZE_SYMBOL, INT8_SYMBOL),
    "avx2": ("pagedllm_quantize_s8_avx2", "pagedllm_gemm_w4a8_avx2"),
}
""":func:`gemm_int8`'s variants on a 4-bit packing: (quantizer, product) symbols of the variant's library."""
INT8_GROUP_MULTIPLE = 16
""":func:`gemm_int8` takes groups of a multiple of this many inputs (x is quantized 16 at a time)."""
PARALLEL_QUANTIZE_ROWS = 64
"""From this many rows :func:`gemm_int8`'s threads quantize x a share of rows each, in a parallel region
before the product's; below, the calling thread does it alone (16 x 4864 inputs: ~8 us)."""
LOCAL_SUMS = 1024
"""The most group sums (rows x groups) the kernel computes itself, on its stack (``LOCAL_SUMS`` in
the C file); past that, :func:`gemm` sums them with torch and hands them in."""


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
def int8_isa() -> str | None:
    """The variant :func:`gemm_int8` runs on a 4-bit packing here: ``avx512-bf16`` with AVX-512-VNNI and
    VBMI (VPDPBUSD), else ``avx2`` (VPMADDUBSW) where that variant runs; None with ``PAGEDLLM_W4A8=0``
    (the switch that keeps 4- and 8-bit layers on bfloat16 activations)."""
    if os.environ.get("PAGEDLLM_W4A8", "1") == "0":
        return None
    return next((name for name in ISAS if int8_runs(name)), None)


@functools.cache
def int8_runs(variant: str) -> bool:
    """Whether :func:`gemm_int8`'s ``variant`` can run here (the AVX-512 one also needs VNNI and VBMI)."""
    vnni = variant != "avx512-bf16" or cpu_has_flags("avx512_vnni", "avx512vbmi")
    return vnni and runs(variant)


def int8_available() -> bool:
    """Whether :func:`gemm_int8` runs here on a 4-bit packing (:func:`int8_isa` is not None)."""
    return int8_isa() is not None


def w8_available() -> bool:
    """Whether :func:`gemm_int8` runs here on an 8-bit packing (:func:`pack8`): the AVX-512 variant only."""
    return int8_isa() == "avx512-bf16"


@functools.cache
def _library(variant: str = "avx512-bf16") -> Path | None:
    """The compiled variant's path (built now if not cached), loaded for Numba; None if it cannot be built."""
    source, _, flags = VARIANTS[variant]
    return build_library(source, flags)


def gemm(x: torch.Tensor, packed: W4Packed, variant: str | None = None) -> torch.Tensor:
    """``x @ W.T`` for ``W[n, k] = scale * (q - zero)``, on as many threads as torch uses.

    x: [..., k] bfloat16 -> [..., n] bfloat16. Sums are float32, rounded to bfloat16 once.
    ``variant``: one of :data:`ISAS` that :func:`runs` here (default :func:`isa`).
    """
    if packed.weight.shape[-1] != BLOCK:
        raise ValueError(
            "gemm takes pack()'s 4-bit layout; an 8-bit weight (pack8) or one packed by pack_spans runs on gemm_int8"
        )
    rows, n, k, group = _checked(x, packed)
    variant = variant or isa()
    if variant is None or not runs(variant):
        raise ValueError(f"the W4 GEMM variant {variant!r} does not run on this CPU; it runs {isa()!r}")
    blocks, m = n // BLOCK, rows.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    if m > 0 and n > 0:
        # NOTE: the AVX2 variant multiplies float32 inputs, the odd ones divided by 16 (see its C file):
        # widened here once, in the product that divides them, not per weight vector
        xs = rows * _odd_divided(k) if variant == "avx2" else rows
        # NOTE: at decode sizes the kernel sums x's groups itself (0): a torch sum costs ~3 us a call
        xsum = 0 if m * (k // group) <= LOCAL_SUMS else rows.view(m, k // group, group).sum(-1, dtype=torch.float32)
        threads = min(_use_threads(torch.get_num_threads()), blocks) if m * n * k >= PARALLEL_MIN_WORK else 1
        w, meta = packed.weight.data_ptr(), packed.meta.data_ptr()
        xsum_at = 0 if isinstance(xsum, int) else xsum.data_ptr()  # [m, groups] float32
        args = (xs.data_ptr(), m, k, w, meta, xsum_at, group, n, blocks, out.data_ptr())
        if threads > 1:
            _parallel(variant)(*args, threads)
        else:
            _serial(variant)(*args)
    return out if rows is x else out.view(*x.shape[:-1], n)


@functools.cache
def _odd_divided(k: int) -> torch.Tensor:
    return torch.tensor([1.0, 0.0625]).repeat(k // 2)  # [1, 1/16, 1, 1/16, ...]: the AVX2 variant's x times this


def _weight_dims(packed: W4Packed) -> tuple[int, int, int]:
    """n, k and group of a packed weight, or a ValueError naming what does not fit."""
    blocks, runs, width = packed.weight.shape
    n, k, group = blocks * BLOCK, runs * (2 if width == BLOCK else 4), packed.group
    if packed.meta.dtype != torch.float32 or packed.meta.shape != (blocks, k // group, 2, BLOCK):
        raise ValueError(f"meta must be float32 [{blocks}, {k // group}, 2, {BLOCK}], got {packed.meta.dtype}")
    return n, k, group


def _x_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x as contiguous rows [m, k], or a ValueError naming what does not fit."""
    if x.dtype != torch.bfloat16 or x.shape[-1] != k:
        raise ValueError(f"x must be bfloat16 [..., {k}], got {x.dtype} {tuple(x.shape)}")
    return x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()


def _checked(x: torch.Tensor, packed: W4Packed) -> tuple[torch.Tensor, int, int, int]:
    """x as contiguous rows [m, k], and n, k, group, or a ValueError naming what does not fit."""
    n, k, group = _weight_dims(packed)
    return _x_rows(x, k), n, k, group


def quantize_rows(x: torch.Tensor, group: int, variant: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] bfloat16 as :func:`gemm_int8` rounds it: levels [m, k] int8 and, per row and group,
    [m, k / group, 2] float32 (the scale max |x| / 127, then the sum of the group's levels)."""
    m, k = x.shape
    if x.dtype != torch.bfloat16 or group % INT8_GROUP_MULTIPLE or k % group:
        raise ValueError(
            f"x must be bfloat16 [m, k] in groups of a multiple of {INT8_GROUP_MULTIPLE} dividing k, "
            f"got {x.dtype} {tuple(x.shape)}, group {group}"
        )
    levels = torch.empty(m, k, dtype=torch.int8)
    stats = torch.empty(m, k // group, 2, dtype=torch.float32)
    variant = _int8_variant(variant)
    if m > 0:
        quantize = _c_function(INT8_VARIANTS[variant][0], _QUANTIZE_ARGS, variant)
        quantize(x.contiguous().data_ptr(), m, k, group, levels.data_ptr(), stats.data_ptr())
    return levels, stats


def _int8_variant(variant: str | None) -> str:
    variant = variant or int8_isa()
    if variant is None or not int8_runs(variant):
        raise ValueError(f"the int8 product's variant {variant!r} does not run on this CPU; it runs {int8_isa()!r}")
    return variant


def int8_pack(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, variant: str | None = None
) -> W4Packed:
    """4-bit levels packed for the int8 product of ``variant`` (default :func:`int8_isa`): :func:`pack_spans`
    for the AVX2 one, :func:`pack` for the AVX-512 one (which :func:`gemm` reads too)."""
    return _INT8_PACKINGS[_int8_variant(variant)][0](q, scales, zeros, group)


_INT8_PACKINGS = {"avx512-bf16": (pack, BLOCK), "avx2": (pack_spans, 2 * BLOCK)}
"""The 4-bit packing each int8 variant reads, and that packing's last size."""


def gemm_int8(x: torch.Tensor, packed: W4Packed, variant: str | None = None) -> torch.Tensor:
    """:func:`gemm` with x rounded to int8 per row and group of the weight (:func:`quantize_rows`) and
    the sums in int32, on as many threads as torch uses. x: [..., k] bfloat16 -> [..., n] bfloat16;
    the weight's group a multiple of :data:`INT8_GROUP_MULTIPLE`. ``variant``: one of :data:`ISAS` that
    :func:`int8_runs` (default :func:`int8_isa`); an 8-bit packing runs on the AVX-512 one only."""
    return Int8Product(packed, variant)(x)


class Int8Product:
    """:func:`gemm_int8` on one packed weight, what it checks and chooses about the weight settled once,
    here: a call looks at x only.

    NOTE: a quantized layer keeps one and calls it every step. At one row a call's Python was ~6 us
    more than the Numba region's on Qwen2.5-0.5B's projections (two threads, weights read from memory).
    """

    def __init__(self, packed: W4Packed, variant: str | None = None) -> None:
        self.n, self.k, self.group = _weight_dims(packed)
        if self.group % INT8_GROUP_MULTIPLE:
            multiple = INT8_GROUP_MULTIPLE
            raise ValueError(f"the int8 product takes groups of a multiple of {multiple} inputs, got {self.group}")
        variant, width = _int8_variant(variant), packed.weight.shape[-1]
        wide = width == 4 * BLOCK
        if wide and variant != "avx512-bf16":
            raise ValueError(f"an 8-bit packing runs on the avx512-bf16 int8 product only, not {variant!r}")
        packer, packed_width = _INT8_PACKINGS[variant]
        if not wide and width != packed_width:
            raise ValueError(f"the {variant} int8 product takes a 4-bit weight packed by {packer.__name__}")
        quantizer, symbol = (QUANTIZE_SYMBOL, W8_SYMBOL) if wide else INT8_VARIANTS[variant]
        self.packed, self.blocks = packed, self.n // BLOCK
        self.parallel = _parallel_int8(variant, quantizer, symbol)
        self.quantize = _c_function(quantizer, _QUANTIZE_ARGS, variant)
        self.product = _c_function(symbol, _INT8_ARGS, variant)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k, group, blocks = self.n, self.k, self.group, self.blocks
        rows = _x_rows(x, k)
        m = rows.shape[0]
        out = torch.empty(m, n, dtype=torch.bfloat16)
        if m > 0 and n > 0:
            # NOTE: one buffer: x's levels [m, k] int8, then per row and group its scale and the sum of its
            # levels ([m, k / group, 2] float32; 4-byte aligned, as k is a multiple of 16)
            work = thread_scratch(m * k + m * (k // group) * 8)
            threads = min(_use_threads(torch.get_num_threads()), blocks) if m * n * k >= PARALLEL_MIN_WORK else 1
            w, meta, y = self.packed.weight.data_ptr(), self.packed.meta.data_ptr(), out.data_ptr()
            x_at, levels_at = rows.data_ptr(), work.data_ptr()
            stats_at = levels_at + m * k
            if threads > 1:
                self.parallel(x_at, m, k, group, levels_at, stats_at, w, meta, n, blocks, y, threads)
            else:
                self.quantize(x_at, m, k, group, levels_at, stats_at)
                self.product(levels_at, stats_at, m, k, w, meta, group, n, 0, blocks, y)
        return out if rows is x else out.view(*x.shape[:-1], n)


_ARGS = ("ptr", "i64", "i64", "ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "ptr")
"""The C function's arguments: x, m, k, weight, meta, xsum, group, n, block0, block1, y."""


@functools.cache
def _c_function(symbol: str, args: tuple[str, ...], variant: str = "avx512-bf16"):
    """The variant's ``symbol`` through ctypes, called on the calling thread (no Numba region to start)."""
    path = _library(variant)
    assert path is not None
    kinds = {"ptr": ctypes.c_void_p, "i64": ctypes.c_int64}
    return load_symbol(path, symbol, tuple(kinds[a] for a in args))


@functools.cache
def _serial(variant: str):
    """The variant's C function called on the calling thread, through ctypes (no Numba region to start)."""
    fn = _c_function(VARIANTS[variant][1], _ARGS, variant)

    def call(x, m, k, w, meta, xsum, group, n, blocks, y):
        fn(x, m, k, w, meta, xsum, group, n, 0, blocks, y)

    return call


@functools.cache
def _parallel(variant: str):
    """A Numba function that deals the column blocks out over ``parts`` threads, an even share each."""
    _library(variant)
    kinds = {"ptr": types.intp, "i64": types.int64}
    kernel = types.ExternalFunction(VARIANTS[variant][1], types.void(*(kinds[a] for a in _ARGS)))

    def run(x, m, k, w, meta, xsum, group, n, blocks, y, parts):
        for t in numba.prange(parts):
            kernel(x, m, k, w, meta, xsum, group, n, blocks * t // parts, blocks * (t + 1) // parts, y)

    return numba.njit(parallel=True, nogil=True, cache=False)(run)


_QUANTIZE_ARGS = ("ptr", "i64", "i64", "i64", "ptr", "ptr")
"""pagedllm_quantize_s8's arguments: x, m, k, group, levels, stats."""
_INT8_ARGS = ("ptr", "ptr", "i64", "i64", "ptr", "ptr", "i64", "i64", "i64", "i64", "ptr")
"""pagedllm_gemm_w4a8's and pagedllm_gemm_w8a8's arguments: levels, stats, m, k, weight, meta, group, n,
block0, block1, y."""


@functools.cache
def _parallel_int8(variant: str, quantizer: str, symbol: str):
    """A Numba function that quantizes x (on the calling thread, or a share of rows per thread from
    :data:`PARALLEL_QUANTIZE_ROWS` rows), then deals the column blocks out over ``parts`` threads."""
    _library(variant)
    kinds = {"ptr": types.intp, "i64": types.int64}
    quantize = types.ExternalFunction(quantizer, types.void(*(kinds[a] for a in _QUANTIZE_ARGS)))
    kernel = types.ExternalFunction(symbol, types.void(*(kinds[a] for a in _INT8_ARGS)))
    parallel_rows = PARALLEL_QUANTIZE_ROWS

    def run(x, m, k, group, levels, stats, w, meta, n, blocks, y, parts):
        if m >= parallel_rows:
            for t in numba.prange(parts):
                r0, r1 = m * t // parts, m * (t + 1) // parts
                quantize(x + r0 * k * 2, r1 - r0, k, group, levels + r0 * k, stats + r0 * (k // group) * 8)
        else:
            quantize(x, m, k, group, levels, stats)
        for t in numba.prange(parts):
            kernel(levels, stats, m, k, w, meta, group, n, blocks * t // parts, blocks * (t + 1) // parts, y)

    return numba.njit(parallel=True, nogil=True, cache=False)(run)
