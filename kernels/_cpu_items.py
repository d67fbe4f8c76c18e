"""Work items of the compiled CPU decode kernel (kernels/paged_decode_attention_cpu.py):
how many per sequence, which thread runs which, the prefetch of a sequence's next block, and
the steps of an item that no specialised copy of the kernel changes (visible blocks, soft-cap,
softmax).

NOTE: Numba's disk cache keys the kernel on its own file: an edit here must also touch
``paged_decode_attention_cpu.py`` (as for ``_fast_exp.py``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import numpy as np
import torch

from ._fast_exp import exp

try:
    import numba
    from llvmlite import ir
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - numba is a dependency; this keeps the package importable
    numba = None  # type: ignore[assignment]

HAS_NUMBA = numba is not None

# NOTE: at least this many work items per thread keeps the threads evenly loaded when
# context lengths differ; fewer sequences than that get their KV heads split.
ITEMS_PER_THREAD = 4

PRANGE_ONLY = dict(
    prange=True, comprehension=False, reduction=False, inplace_binop=False, setitem=False, numpy=False, stencil=False
)
"""Numba's ``parallel`` options for the kernel: only its ``prange`` over the threads runs in parallel.

NOTE: with ``parallel=True`` Numba also turned the plan's array work (:func:`thread_items`'s
``np.zeros``, ``np.empty``, inlined into the kernel) into parallel regions of their own, each a
wake-up of the whole pool before the items start: at the Qwen2.5-0.5B shape (batch 16, 2
threads) a call with nothing to read took 27 us against 8 us with the ``prange`` alone, and a
region that waits for a busy core costs a time slice. The plan is now also its own function.
"""


def _device_function(fn):
    """A helper the kernel calls: compiled into it by Numba (inlined), plain Python without numba."""
    return numba.njit(inline="always", fastmath=True, boundscheck=False)(fn) if HAS_NUMBA else fn


@_device_function
def visible_blocks(start, end, block_size):
    """The logical blocks that hold positions ``start .. end - 1``: ``range(first, last)``."""
    if end <= start:
        return 0, 0
    return start // block_size, (end + block_size - 1) // block_size


@_device_function
def soft_cap(scores, cap):
    """In place: ``cap * tanh(score / cap)``."""
    heads, length = scores.shape
    for i in range(heads):
        for p in range(length):
            scores[i, p] = cap * np.tanh(scores[i, p] / cap)


@_device_function
def softmax_rows(scores):
    """In place: each row of scores becomes probabilities (an empty row stays empty).

    NOTE: :data:`exp` vectorises where ``np.exp`` calls the C library once per score; it
    differs from it in the last bit now and then.
    """
    for i in range(scores.shape[0]):
        row = scores[i]
        if len(row) == 0:
            continue
        top = row.max()
        total = np.float32(0.0)
        for p in range(len(row)):
            e = exp(row[p] - top)
            row[p] = e
            total += e
        row *= np.float32(1.0) / total


def choose_kv_splits(num_seqs: int, num_kv_heads: int, threads: int) -> int:
    """Items per sequence: 1 (whole blocks streamed) unless there are too few sequences to
    give each thread ``ITEMS_PER_THREAD`` items; then the smallest divisor of the KV heads that does."""
    wanted = -(-ITEMS_PER_THREAD * threads // max(num_seqs, 1))
    for splits in range(1, num_kv_heads + 1):
        if num_kv_heads % splits == 0 and splits >= wanted:
            return splits
    return num_kv_heads


def _own_function(fn):
    """A helper compiled on its own and called, not inlined: its array work stays serial code
    whatever the caller's parallel options (plain Python without numba)."""
    return numba.njit(fastmath=True, boundscheck=False)(fn) if HAS_NUMBA else fn


@_own_function
def thread_items(context_lens, window, kv_splits, threads):
    """``[threads, items + 1]``: row t lists the work items thread t runs (count first), the
    longest first, each given to the thread with the least work so far (visible positions).

    NOTE: Numba splits a ``prange`` into equal runs of iterations, whatever each costs: 16
    sequences of ShareGPT-like lengths gave one of two threads 35% more than half the work.
    """
    num_items = len(context_lens) * kv_splits
    work = np.empty(num_items, np.int64)
    for item in range(num_items):
        end = context_lens[item // kv_splits]
        work[item] = (min(end, window) if window > 0 else end) + 16  # NOTE: + an item's fixed cost
    if num_items > threads:
        return deal_by_cost(work, threads)
    plan = np.zeros((threads, num_items + 1), np.int64)
    for item in range(num_items):  # NOTE: one item each, no sort (batch 1: its KV heads)
        plan[item, 0], plan[item, 1] = 1, item
    return plan


@_own_function
def deal_by_cost(cost, threads):
    """``[threads, items + 1]``: row t lists the items thread t runs (count first), the costliest
    dealt first, each to the thread with the least ``cost`` so far."""
    plan = np.zeros((threads, len(cost) + 1), np.int64)
    load = np.zeros(threads, np.int64)
    for item in np.argsort(-cost, kind="mergesort"):
        t = np.argmin(load)
        load[t] += cost[item]
        plan[t, 0] += 1
        plan[t, plan[t, 0]] = item
    return plan


PAGE_BYTES = 4096
"""Where the CPU's own prefetcher stops following a stream (a 4 KiB page)."""


def _llvm_prefetch(typingctx, cache, block, offset):
    """``llvm.prefetch`` (read, keep in every level) of the cache line ``offset`` bytes into
    ``cache[block]``: no load and no wait, and the page's translation is looked up too.

    A Numba intrinsic: :func:`prefetch_block` calls it once per page of a block.
    """
    sig = numba.types.void(cache, numba.types.intp, numba.types.intp)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0"
        )
        stride = cgutils.unpack_tuple(builder, array.strides)[0]
        start = builder.add(builder.mul(args[1], stride), args[2])
        address = builder.gep(builder.bitcast(array.data, i8p), [start])
        builder.call(fn, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


def _no_prefetch(cache, block, offset) -> None:
    """Without numba the kernel runs as Python, where a prefetch has nothing to do."""


_prefetch: Callable[..., None] = intrinsic(_llvm_prefetch) if HAS_NUMBA else _no_prefetch


@_device_function
def prefetch_block(cache, block):
    """Start the reads of ``cache[block]``: the first line of each of its pages.

    NOTE: a sequence's blocks lie anywhere in the cache, so each block starts a new stream;
    within a page the CPU's prefetcher follows on its own once the first lines come in.
    """
    block_bytes = cache.strides[0]
    for offset in range(0, block_bytes, PAGE_BYTES):
        _prefetch(cache, block, offset)


class _ThreadsSet(threading.local):
    asked = 0
    """The count :func:`_use_threads` was last asked for on this thread (0: never)."""
    got = 0
    """What it set Numba's count to then."""


_threads_set = _ThreadsSet()


def _use_threads(threads: int) -> int:
    """Numba's pool follows torch's thread count (the engine sets that from the CPU quota),
    within the threads it has; returns how many it now uses.

    NOTE: Numba's count is per calling thread, and asking it costs ~2 us; every kernel call asks
    here, so the count last set is remembered per thread and Numba is asked only when it changes
    (nothing else in the package sets it).
    """
    seen = _threads_set
    if seen.asked == threads:
        return seen.got
    _launch_pool()
    got = min(threads, numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    if numba.get_num_threads() != got:
        numba.set_num_threads(got)
    seen.asked, seen.got = threads, got
    return got


@functools.cache
def _launch_pool() -> None:
    """Start Numba's thread pool once, leaving torch's thread count as it was.

    NOTE: with Numba's OpenMP layer both share one OpenMP runtime, and starting the pool
    sets OpenMP's thread count to NUMBA_NUM_THREADS (every CPU of the host, not the
    process's quota): torch would go on with that many threads, the oversubscription the
    engine's thread choice exists to avoid.
    """
    threads = torch.get_num_threads()
    numba.get_num_threads()  # starts the pool
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
