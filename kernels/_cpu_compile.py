"""Building and loading the CPU kernels written in C (bf16_gemm_cpu.c, w4_gemm_cpu.c, ...).

A kernel's C source is compiled on first use with the system's C compiler (``$CC``, ``cc``,
gcc or clang) into the cache directory (``$PAGEDLLM_CACHE`` or ``~/.cache/pagedllm``, under
``kernels/``; a temporary one where that cannot be written), keyed by the hash of the source,
the headers it includes from beside it and the flags, then loaded into the process so Numba can call its symbols.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

try:
    import llvmlite.binding
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; this keeps the package importable
    numba = None  # type: ignore[assignment]

__all__ = [
    "AVX2_CFLAGS",
    "AVX512_BF16_CFLAGS",
    "build_library",
    "cpu_has_avx2",
    "cpu_has_avx512_bf16",
    "cpu_has_flags",
    "cpu_has_isa",
    "load_symbol",
]

AVX512_BF16_CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-shared", "-fPIC")
AVX2_CFLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has_flags(*flags: str) -> bool:
    """Whether ``/proc/cpuinfo`` lists every one of ``flags`` (``avx512_vnni``, ``avx512vbmi``, ...)."""
    return set(flags) <= _cpu_flags()


def cpu_has_avx512_bf16() -> bool:
    """Whether the C kernels can run here: x86-64 with AVX-512-BF16, Numba importable, and
    ``PAGEDLLM_CPU_GEMM`` not ``0`` (the switch that keeps every such kernel off)."""
    if os.environ.get("PAGEDLLM_CPU_GEMM", "1") == "0" or numba is None:
        return False
    return platform.machine() in ("x86_64", "AMD64") and {"avx512f", "avx512_bf16"} <= _cpu_flags()


def cpu_has_avx2() -> bool:
    """Whether the AVX2 variants of the C kernels can run here: x86-64 with AVX2 and FMA, Numba
    importable, and ``PAGEDLLM_CPU_GEMM`` not ``0``."""
    if os.environ.get("PAGEDLLM_CPU_GEMM", "1") == "0" or numba is None:
        return False
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= _cpu_flags()


def cpu_has_avx512f() -> bool:
    """Whether the CPU has AVX-512 Foundation (where oneDNN's own float32 GEMM is kept)."""
    return "avx512f" in _cpu_flags()


def cpu_has_isa(variant: str) -> bool:
    """Whether a C kernel's variant named ``variant`` (``avx512-bf16``, ``avx2`` or ``avx2-f32``) can run here."""
    return {"avx512-bf16": cpu_has_avx512_bf16, "avx2": cpu_has_avx2, "avx2-f32": cpu_has_avx2}[variant]()


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")
    return Path(root) / "kernels"


_LOCAL_INCLUDE = re.compile(rb'^#include "([^"/]+)"', re.MULTILINE)
"""``#include "name"`` of a header beside the source (the compiler finds it there too)."""


def build_library(source_path: Path, cflags: tuple[str, ...]) -> Path | None:
    """The compiled ``source_path`` (built now if not cached), loaded for Numba; None if it cannot be built."""
    compiler = next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)
    try:
        source = source_path.read_bytes()
        # NOTE: the headers it includes from its own directory are part of what it builds from
        headers = [(source_path.parent / name.decode()).read_bytes() for name in _LOCAL_INCLUDE.findall(source)]
    except OSError:  # an install without the package's data files
        return None
    tag = hashlib.sha256(b"".join([source, *headers]) + " ".join(cflags).encode()).hexdigest()[:16]
    for directory in (_cache_dir(), Path(tempfile.gettempdir()) / f"pagedllm-{os.getuid()}"):
        path = directory / f"{source_path.stem}-{tag}.so"
        if not path.exists() and (compiler is None or not _build(compiler, source_path, cflags, path)):
            continue
        try:
            ctypes.CDLL(str(path))  # NOTE: a damaged file fails here, not inside a compiled caller
            llvmlite.binding.load_library_permanently(str(path))
        except OSError:
            continue
        return path
    return None


def _build(compiler: str, source: Path, cflags: tuple[str, ...], path: Path) -> bool:
    """Compile into a temporary name, then move it in place (two processes may build at once)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as tmp:
            partial = Path(tmp.name)
        done = subprocess.run([compiler, *cflags, "-o", str(partial), str(source)], capture_output=True, timeout=120)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            return False
        os.replace(partial, path)
        return True
    except (OSError, subprocess.SubprocessError):
        return False


@functools.cache
def load_symbol(path: Path, symbol: str, argtypes: tuple) -> Callable[..., None]:
    """``symbol`` of the library at ``path`` as a ctypes function (no result) taking ``argtypes``."""
    fn = getattr(ctypes.CDLL(str(path)), symbol)
    fn.restype = None
    fn.argtypes = list(argtypes)
    return fn
