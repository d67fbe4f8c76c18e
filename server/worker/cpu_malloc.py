"""The C heap keeps what a CPU step frees, so the next step's large tensors reuse it.

A prefill step of a real model makes tensors of tens of MB per layer (Qwen2.5-0.5B's gate/up
output for 2,048 tokens: 40 MB). glibc's ``malloc`` serves every allocation above its mmap
threshold (at most 32 MB, adjusted as it goes) with fresh pages from the kernel and hands
them back on ``free``: each step then faults in and zeroes those pages again, on the critical
path of the GEMM that writes them. Measured on a 2-core AVX-512-BF16 CPU, that GEMM at 2,048
rows runs at 740-760 GFLOP/s with the default and at 990-1,010 with freed memory kept (either
GEMM path: this kernel's and oneDNN's).

:func:`keep_freed_memory` raises glibc's mmap and trim thresholds to 1 GiB once per process:
allocations come from the heap and freed ones stay there for the next. The process's
resident memory then stays at its high-water mark, as under the tcmalloc or jemalloc that
CPU inference servers commonly preload. It does nothing off Linux/glibc or with
``PAGEDLLM_CPU_MALLOC=0``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 30
"""Bytes below which allocations come from the heap, and free memory at its top that it keeps."""


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's thresholds (once); whether they are now in effect."""
    if sys.platform != "linux" or os.environ.get("PAGEDLLM_CPU_MALLOC", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl has no such symbol
    except (OSError, AttributeError):
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, THRESHOLD) == 1
    if ok:
        logger.info("the C heap keeps freed memory for reuse (PAGEDLLM_CPU_MALLOC=0: glibc's default)")
    return ok
