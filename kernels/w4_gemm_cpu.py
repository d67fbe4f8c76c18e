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

With AVX2 and FMA but no AVX-512-BF16, :func:`gemm` runs kernels/w4_gemm_avx2.c on the same packing
(levels converted to float32 in registers, FMA; the C file says how). A Qwen2.5-0.5B layer on 2 threads
of an AVX2 EPYC (Zen 3): 1.05 / 6.2 ms at 1 / 16 rows against 1.62 / 5.1 in bf16 and torch int4's 1.36 / 9.8.

Built as bf16_gemm_cpu's kernel is (kernels/_cpu_compile.py). :func:`isa` names the variant that runs
(None: no compiler or Numba, neither ISA, or ``PAGEDLLM_CPU_GEMM=0``); :func:`int8_available` needs the
AVX-512-BF16 one, VNNI, VBMI and ``PAGEDLLM_W4A8`` not ``0``. The oracles: :func:`w4_gemm_reference`,
:func:`w4a8_reference`.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import NamedTuple

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
    cpu_has_avx2,
    cpu_has_avx512_bf16,
    cpu_has_flags,
    load_symbol,
)
from ._cpu_items import _use_threads
from ._cpu_memory import aligned_empty

__all__ = [
    "BLOCK",
    "ISAS",
    "W4Packed",
    "available",
    "can_pack",
    "gemm",
    "gemm_int8",
    "int8_available",
    "isa",
    "pack",
    "pack8",
    "quantize_rows",
    "runs",
    "unpack",
    "w4_gemm_reference",
    "w4a8_reference",
]

BLOCK = 16
"""Output columns per packed block: the weight's rows must be a multiple of it."""
SOURCE = Path(__file__).with_suffix(".c")
SYMBOL = "pagedllm_gemm_w4"
ISAS = ("avx512-bf16", "avx2")
""":func:`gemm`'s variants, fastest first: (source, symbol, flags) in :data:`VARIANTS`."""
VARIANTS = {
    "avx512-bf16": (SOURCE, SYMBOL, AVX512_BF16_CFLAGS),
    "avx2": (Path(__file__).with_name("w4_gemm_avx2.c"), "pagedllm_gemm_w4_avx2", AVX2_CFLAGS),
}
_CPU_HAS = {"avx512-bf16": cpu_has_avx512_bf16, "avx2": cpu_has_avx2}
PARALLEL_MIN_WORK = 1 << 18
"""Below this many multiply-adds a call runs on the calling thread: starting the pool costs more than the product."""
INT8_SYMBOL = "pagedllm_gemm_w4a8"
W8_SYMBOL = "pagedllm_gemm_w8a8"
QUANTIZE_SYMBOL = "pagedllm_quantize_s8"
INT8_GROUP_MULTIPLE = 16
""":func:`gemm_int8` takes groups of a multiple of this many inputs (x is quantized 16 at a time)."""
PARALLEL_QUANTIZE_ROWS = 64
"""From this many rows :func:`gemm_int8`'s threads quantize x a share of rows each, in a parallel region
before the product's; below, the calling thread does it alone (16 x 4864 inputs: ~8 us)."""
LOCAL_SUMS = 1024
"""The most group sums (rows x groups) the kernel computes itself, on its stack (``LOCAL_SUMS`` in
the C file); past that, :func:`gemm` sums them with torch and hands them in."""


class W4Packed(NamedTuple):
    """A 4-bit weight in the kernel's layout (both tensors 64-byte aligned, large ones on huge pages)."""

    weight: torch.Tensor
    """4-bit (:func:`pack`): [n / 16, k / 2, 16] uint8, byte c of pair p of block b holding
    q[16 b + c, 2 p] | q[16 b + c, 2 p + 1] << 4; 8-bit (:func:`pack8`, :func:`gemm_int8` only):
    [n / 16, k / 4, 64] uint8, byte 4 c + i of quad t holding q[16 b + c, 4 t + i]."""
    meta: torch.Tensor
    """[n / 16, k / group, 2, 16] float32: per block and group, the 16 columns' scales, then 128 + their zeros."""
    group: int


def isa() -> str | None:
    """The variant :func:`gemm` runs here (one of :data:`ISAS`), or None: the first whose
    instructions the CPU has (with Numba and ``PAGEDLLM_CPU_GEMM`` not ``0``) and whose
    source a C compiler built."""
    return next((name for name in ISAS if runs(name)), None)


@functools.cache
def runs(variant: str) -> bool:
    """Whether ``variant`` can run on this CPU (AVX-512-BF16 CPUs run the AVX2 one too).

    NOTE: cached: :func:`gemm` asks on every call, and reading the CPU's flags takes ~100 us."""
    return _CPU_HAS[variant]() and _library(variant) is not None


def available() -> bool:
    """Whether :func:`gemm` runs here (:func:`isa` is not None)."""
    return isa() is not None


@functools.cache
def int8_available() -> bool:
    """Whether :func:`gemm_int8` runs here: :func:`available`, AVX-512-VNNI and VBMI, and
    ``PAGEDLLM_W4A8`` not ``0`` (the switch that keeps 4- and 8-bit layers on bfloat16 activations)."""
    if os.environ.get("PAGEDLLM_W4A8", "1") == "0":
        return False
    return runs("avx512-bf16") and cpu_has_flags("avx512_vnni", "avx512vbmi")


@functools.cache
def _library(variant: str = "avx512-bf16") -> Path | None:
    """The compiled variant's path (built now if not cached), loaded for Numba; None if it cannot be built."""
    source, _, flags = VARIANTS[variant]
    return build_library(source, flags)


def can_pack(q: torch.Tensor, group: int) -> bool:
    """Whether :func:`pack` takes levels ``q`` [n, k] in groups of ``group`` inputs: uint8 on the CPU,
    n a multiple of :data:`BLOCK`, ``group`` even and dividing k."""
    if q.device.type != "cpu" or q.dtype != torch.uint8 or q.dim() != 2:
        return False
    n, k = q.shape
    return n % BLOCK == 0 and group > 0 and group % 2 == 0 and k % group == 0


def pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> W4Packed:
    """Levels ``q`` [n, k] (uint8, 0..15), ``scales`` and ``zeros`` [n, k / group] in the kernel's layout."""
    if not can_pack(q, group):
        raise ValueError(
            f"the CPU W4 GEMM packs uint8 CPU levels [n, k] with n a multiple of {BLOCK} and an even group "
            f"dividing k, got {tuple(q.shape)} {q.dtype} on {q.device}, group {group}"
        )
    n, k = q.shape
    _check_scales(scales, zeros, n, k // group)
    pairs = q.reshape(n // BLOCK, BLOCK, k // 2, 2).permute(0, 2, 1, 3)
    weight = aligned_empty(n * k // 2, torch.uint8).view(n // BLOCK, k // 2, BLOCK)
    weight.copy_(pairs[..., 0] | (pairs[..., 1] << 4))
    return W4Packed(weight, _meta(scales, zeros, group), group)


def pack8(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> W4Packed:
    """8-bit levels ``q`` [n, k] (uint8, 0..255), ``scales`` and ``zeros`` [n, k / group] in the layout
    :func:`gemm_int8` multiplies as it is: weight [n / 16, k / 4, 64], quad t of block b holding
    ``q[16 b + c, 4 t + i]`` at byte 4 c + i; meta as :func:`pack`'s. k a multiple of 4."""
    if not can_pack(q, group) or q.shape[1] % 4:
        raise ValueError(
            f"the CPU W8 GEMM packs uint8 CPU levels [n, k] with n a multiple of {BLOCK}, k of 4 and an even "
            f"group dividing k, got {tuple(q.shape)} {q.dtype} on {q.device}, group {group}"
        )
    n, k = q.shape
    _check_scales(scales, zeros, n, k // group)
    weight = aligned_empty(n * k, torch.uint8).view(n // BLOCK, k // 4, 4 * BLOCK)
    weight.view(n // BLOCK, k // 4, BLOCK, 4).copy_(q.reshape(n // BLOCK, BLOCK, k // 4, 4).permute(0, 2, 1, 3))
    return W4Packed(weight, _meta(scales, zeros, group), group)


def _check_scales(scales: torch.Tensor, zeros: torch.Tensor, n: int, groups: int) -> None:
    if scales.shape != (n, groups) or zeros.shape != (n, groups):
        got = f"{tuple(scales.shape)}, {tuple(zeros.shape)}"
        raise ValueError(f"scales and zeros must be [{n}, {groups}], got {got}")


def _meta(scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """[n / 16, groups, 2, 16] float32: per block and group the 16 columns' scales, then 128 + their zeros."""
    n, groups = scales.shape
    per_block = [t.float().reshape(n // BLOCK, BLOCK, -1).transpose(1, 2) for t in (scales, 128.0 + zeros.float())]
    meta = aligned_empty(n * groups * 2, torch.float32).view(n // BLOCK, groups, 2, BLOCK)
    meta.copy_(torch.stack(per_block, dim=2))
    return meta


def unpack(packed: W4Packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The levels [n, k] (uint8), scales and zeros [n, k / group] (float32) that :func:`pack` packed."""
    blocks, pairs, _ = packed.weight.shape
    levels = torch.stack([packed.weight & 15, packed.weight >> 4], dim=-1)  # [n/16, k/2, 16, 2]
    q = levels.permute(0, 2, 1, 3).reshape(blocks * BLOCK, pairs * 2)
    scales, offsets = (packed.meta[:, :, i].transpose(1, 2).reshape(blocks * BLOCK, -1) for i in (0, 1))
    return q, scales, offsets - 128.0


def gemm(x: torch.Tensor, packed: W4Packed, variant: str | None = None) -> torch.Tensor:
    """``x @ W.T`` for ``W[n, k] = scale * (q - zero)``, on as many threads as torch uses.

    x: [..., k] bfloat16 -> [..., n] bfloat16. Sums are float32, rounded to bfloat16 once.
    ``variant``: one of :data:`ISAS` that :func:`runs` here (default :func:`isa`).
    """
    if packed.weight.shape[-1] != BLOCK:
        raise ValueError("gemm takes 4-bit packing (pack); an 8-bit weight (pack8) runs on gemm_int8")
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


def _checked(x: torch.Tensor, packed: W4Packed) -> tuple[torch.Tensor, int, int, int]:
    """x as contiguous rows [m, k], and n, k, group, or a ValueError naming what does not fit."""
    blocks, runs, width = packed.weight.shape
    n, k, group = blocks * BLOCK, runs * (4 if width == 4 * BLOCK else 2), packed.group
    if x.dtype != torch.bfloat16 or x.shape[-1] != k:
        raise ValueError(f"x must be bfloat16 [..., {k}], got {x.dtype} {tuple(x.shape)}")
    if packed.meta.dtype != torch.float32 or packed.meta.shape != (blocks, k // group, 2, BLOCK):
        raise ValueError(f"meta must be float32 [{blocks}, {k // group}, 2, {BLOCK}], got {packed.meta.dtype}")
    return (x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()), n, k, group


def quantize_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
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
    if m > 0:
        quantize = _c_function(QUANTIZE_SYMBOL, _QUANTIZE_ARGS)
        quantize(x.contiguous().data_ptr(), m, k, group, levels.data_ptr(), stats.data_ptr())
    return levels, stats


def gemm_int8(x: torch.Tensor, packed: W4Packed) -> torch.Tensor:
    """:func:`gemm` with x rounded to int8 per row and group of the weight (:func:`quantize_rows`) and
    the sums in int32, on as many threads as torch uses. x: [..., k] bfloat16 -> [..., n] bfloat16;
    the weight's group a multiple of :data:`INT8_GROUP_MULTIPLE`."""
    rows, n, k, group = _checked(x, packed)
    if group % INT8_GROUP_MULTIPLE:
        raise ValueError(f"the int8 product takes groups of a multiple of {INT8_GROUP_MULTIPLE} inputs, got {group}")
    blocks, m = n // BLOCK, rows.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    if m > 0 and n > 0:
        levels = torch.empty(m, k, dtype=torch.int8)
        stats = torch.empty(m, k // group, 2, dtype=torch.float32)  # per row and group: scale, sum of levels
        threads = min(_use_threads(torch.get_num_threads()), blocks) if m * n * k >= PARALLEL_MIN_WORK else 1
        w, meta, y = packed.weight.data_ptr(), packed.meta.data_ptr(), out.data_ptr()
        x_at, levels_at, stats_at = rows.data_ptr(), levels.data_ptr(), stats.data_ptr()
        symbol = W8_SYMBOL if packed.weight.shape[-1] == 4 * BLOCK else INT8_SYMBOL
        if threads > 1:
            _parallel_int8(symbol)(x_at, m, k, group, levels_at, stats_at, w, meta, n, blocks, y, threads)
        else:
            _c_function(QUANTIZE_SYMBOL, _QUANTIZE_ARGS)(x_at, m, k, group, levels_at, stats_at)
            _c_function(symbol, _INT8_ARGS)(levels_at, stats_at, m, k, w, meta, group, n, 0, blocks, y)
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
def _parallel_int8(symbol: str):
    """A Numba function that quantizes x (on the calling thread, or a share of rows per thread from
    :data:`PARALLEL_QUANTIZE_ROWS` rows), then deals the column blocks out over ``parts`` threads."""
    _library()
    kinds = {"ptr": types.intp, "i64": types.int64}
    quantize = types.ExternalFunction(QUANTIZE_SYMBOL, types.void(*(kinds[a] for a in _QUANTIZE_ARGS)))
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


def w4_gemm_reference(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """The oracle: ``x @ W.T`` on the dequantized weight ``W = scale * (q - zero)`` in float64, rounded to
    bfloat16 once. q: [n, k]; scales, zeros: [n, k / group]."""
    w = (q.double() - zeros.double().repeat_interleave(group, 1)) * scales.double().repeat_interleave(group, 1)
    return (x.double() @ w.T).to(torch.bfloat16)


def w4a8_reference(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """The oracle of :func:`gemm_int8`: x rounded as the kernel rounds it (per row and group, scale
    max |x| / 127 in float32, levels x * (127 / max) rounded to nearest even), then
    :func:`w4_gemm_reference` on the dequantized x."""
    rows = x.float().reshape(-1, x.shape[-1])
    m, k = rows.shape
    grouped = rows.view(m, k // group, group)
    top = grouped.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros_like(top))
    levels = torch.round(grouped * inverse)
    dequantized = (levels.double() * (top / 127.0).double()).view(m, k)
    out = w4_gemm_reference(dequantized, q, scales, zeros, group)
    return out.view(*x.shape[:-1], out.shape[-1])
