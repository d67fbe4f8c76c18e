"""A 4-bit weight-only GEMM (W4A16) for CPUs with AVX-512-BF16 (kernels/w4_gemm_cpu.c), for quantized linears.

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

Compiled and loaded as bf16_gemm_cpu's kernel is (kernels/_cpu_compile.py). :func:`available`
is false where that kernel's is (no AVX-512-BF16, compiler or Numba, ``PAGEDLLM_CPU_GEMM=0``).
:func:`w4_gemm_reference` is the oracle.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import torch

try:
    import numba
    from numba import types
except ImportError:  # pragma: no cover - numba is a dependency; this keeps the package importable
    numba = None  # type: ignore[assignment]

from ._cpu_compile import AVX512_BF16_CFLAGS, build_library, cpu_has_avx512_bf16, load_symbol
from ._cpu_items import _use_threads
from ._cpu_memory import aligned_empty

__all__ = ["BLOCK", "W4Packed", "available", "can_pack", "gemm", "pack", "unpack", "w4_gemm_reference"]

BLOCK = 16
"""Output columns per packed block: the weight's rows must be a multiple of it."""
SOURCE = Path(__file__).with_suffix(".c")
SYMBOL = "pagedllm_gemm_w4"
PARALLEL_MIN_WORK = 1 << 18
"""Below this many multiply-adds a call runs on the calling thread: starting the pool costs more than the product."""
LOCAL_SUMS = 1024
"""The most group sums (rows x groups) the kernel computes itself, on its stack (``LOCAL_SUMS`` in
the C file); past that, :func:`gemm` sums them with torch and hands them in."""


class W4Packed(NamedTuple):
    """A 4-bit weight in the kernel's layout (both tensors 64-byte aligned, large ones on huge pages)."""

    weight: torch.Tensor
    """[n / 16, k / 2, 16] uint8: byte c of pair p of block b holds q[16 b + c, 2 p] | q[16 b + c, 2 p + 1] << 4."""
    meta: torch.Tensor
    """[n / 16, k / group, 2, 16] float32: per block and group, the 16 columns' scales, then 128 + their zeros."""
    group: int


@functools.cache
def available() -> bool:
    """Whether :func:`gemm` runs here: x86-64 with AVX-512-BF16, Numba, a C compiler that
    built the kernel, and ``PAGEDLLM_CPU_GEMM`` not ``0``."""
    return cpu_has_avx512_bf16() and _library() is not None


@functools.cache
def _library() -> Path | None:
    return build_library(SOURCE, AVX512_BF16_CFLAGS)


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
    if scales.shape != (n, k // group) or zeros.shape != (n, k // group):
        got = f"{tuple(scales.shape)}, {tuple(zeros.shape)}"
        raise ValueError(f"scales and zeros must be [{n}, {k // group}], got {got}")
    pairs = q.reshape(n // BLOCK, BLOCK, k // 2, 2).permute(0, 2, 1, 3)
    weight = aligned_empty(n * k // 2, torch.uint8).view(n // BLOCK, k // 2, BLOCK)
    weight.copy_(pairs[..., 0] | (pairs[..., 1] << 4))
    # meta: [n/16, groups, 2, 16]; each [n, groups] tensor -> [n/16, groups, 16]
    per_block = [t.float().reshape(n // BLOCK, BLOCK, -1).transpose(1, 2) for t in (scales, 128.0 + zeros.float())]
    meta = aligned_empty(n * (k // group) * 2, torch.float32).view(n // BLOCK, k // group, 2, BLOCK)
    meta.copy_(torch.stack(per_block, dim=2))
    return W4Packed(weight, meta, group)


def unpack(packed: W4Packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The levels [n, k] (uint8), scales and zeros [n, k / group] (float32) that :func:`pack` packed."""
    blocks, pairs, _ = packed.weight.shape
    levels = torch.stack([packed.weight & 15, packed.weight >> 4], dim=-1)  # [n/16, k/2, 16, 2]
    q = levels.permute(0, 2, 1, 3).reshape(blocks * BLOCK, pairs * 2)
    scales, offsets = (packed.meta[:, :, i].transpose(1, 2).reshape(blocks * BLOCK, -1) for i in (0, 1))
    return q, scales, offsets - 128.0


def gemm(x: torch.Tensor, packed: W4Packed) -> torch.Tensor:
    """``x @ W.T`` for ``W[n, k] = scale * (q - zero)``, on as many threads as torch uses.

    x: [..., k] bfloat16 -> [..., n] bfloat16. Sums are float32, rounded to bfloat16 once.
    """
    blocks, pairs, _ = packed.weight.shape
    n, k, group = blocks * BLOCK, pairs * 2, packed.group
    if x.dtype != torch.bfloat16 or x.shape[-1] != k:
        raise ValueError(f"x must be bfloat16 [..., {k}], got {x.dtype} {tuple(x.shape)}")
    if packed.meta.dtype != torch.float32 or packed.meta.shape != (blocks, k // group, 2, BLOCK):
        raise ValueError(f"meta must be float32 [{blocks}, {k // group}, 2, {BLOCK}], got {packed.meta.dtype}")
    rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    if m > 0 and n > 0:
        # NOTE: at decode sizes the kernel sums x's groups itself (0): a torch sum costs ~3 us a call
        xsum = 0 if m * (k // group) <= LOCAL_SUMS else rows.view(m, k // group, group).sum(-1, dtype=torch.float32)
        threads = min(_use_threads(torch.get_num_threads()), blocks) if m * n * k >= PARALLEL_MIN_WORK else 1
        w, meta = packed.weight.data_ptr(), packed.meta.data_ptr()
        xsum_at = 0 if isinstance(xsum, int) else xsum.data_ptr()  # [m, groups] float32
        args = (rows.data_ptr(), m, k, w, meta, xsum_at, group, n, blocks, out.data_ptr())
        if threads > 1:
            _parallel()(*args, threads)
        else:
            _serial()(*args)
    return out if rows is x else out.view(*x.shape[:-1], n)


_ARGS = ("ptr", "i64", "i64", "ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "ptr")
"""The C function's arguments: x, m, k, weight, meta, xsum, group, n, block0, block1, y."""


@functools.cache
def _serial():
    """The C function called on the calling thread, through ctypes (no Numba region to start)."""
    path = _library()
    assert path is not None
    kinds = {"ptr": ctypes.c_void_p, "i64": ctypes.c_int64}
    fn = load_symbol(path, SYMBOL, tuple(kinds[a] for a in _ARGS))

    def call(x, m, k, w, meta, xsum, group, n, blocks, y):
        fn(x, m, k, w, meta, xsum, group, n, 0, blocks, y)

    return call


@functools.cache
def _parallel():
    """A Numba function that deals the column blocks out over ``parts`` threads, an even share each."""
    _library()
    kinds = {"ptr": types.intp, "i64": types.int64}
    kernel = types.ExternalFunction(SYMBOL, types.void(*(kinds[a] for a in _ARGS)))

    def run(x, m, k, w, meta, xsum, group, n, blocks, y, parts):
        for t in numba.prange(parts):
            kernel(x, m, k, w, meta, xsum, group, n, blocks * t // parts, blocks * (t + 1) // parts, y)

    return numba.njit(parallel=True, nogil=True, cache=False)(run)


def w4_gemm_reference(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """The oracle: ``x @ W.T`` on the dequantized weight ``W = scale * (q - zero)`` in float64, rounded to
    bfloat16 once. q: [n, k]; scales, zeros: [n, k / group]."""
    w = (q.double() - zeros.double().repeat_interleave(group, 1)) * scales.double().repeat_interleave(group, 1)
    return (x.double() @ w.T).to(torch.bfloat16)
