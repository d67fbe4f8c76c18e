"""CPU decode attention, one layer: the kernels' torch reference, the torch backend's
planned path (cpu_attention.py) at several grouping thresholds, the compiled kernel the
``numba`` backend runs (kernels/paged_decode_attention_cpu.py), and SDPA over K/V that is
already contiguous, padded to the longest context (a static batch's layout, no gather),
and, as the memory's own limit, a plain sum over as many bytes laid out in order.

NOTE: one layer's cache of a small batch fits in the CPU's last-level cache and stays
there across repeats; in the engine every layer has its own cache, read from memory.
``--layers 8`` cycles through that many caches to show the memory-bound numbers.

ShareGPT-like context lengths (mean input 161 plus up to 128 generated tokens), blocks
scattered at random over the cache, of each of ``--block-sizes`` tokens (every block that
lies elsewhere starts a new stream of reads: larger blocks, fewer of them).

    python -m benchmarks.cpu_attention --threads 2 --batch 16 64
    python -m benchmarks.cpu_attention --threads 2 --batch 16 64 --dtype bfloat16
    python -m benchmarks.cpu_attention --threads 2 --batch 16 64 --dtype bfloat16 --kv-cache-dtype int8
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import HelpFormatter, set_threads
from pagedllm.kernels import paged_decode_attention_reference
from pagedllm.kernels.kv_quant import CACHE_DTYPE_OF, quantize
from pagedllm.kernels.paged_decode_attention_cpu import paged_decode_attention_cpu
from pagedllm.server.config import KV_CACHE_DTYPES
from pagedllm.server.worker import cpu_attention


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def make_case(batch: int, heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int, dtype: torch.dtype):
    rng = np.random.default_rng(seed)
    lens = np.round(rng.lognormal(math.log(161) - 0.32, 0.8, batch)).clip(1, 1024).astype(int)
    lens += rng.integers(0, 128, batch)
    width = -(-int(lens.max()) // block_size)
    num_blocks = 4 * batch * width
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    perm = torch.randperm(num_blocks)
    tables = torch.zeros(batch, width, dtype=torch.int32)
    used = 0
    for s, n in enumerate(lens):
        k = -(-int(n) // block_size)
        tables[s, :k] = perm[used : used + k].int()
        used += k
    query = torch.randn(batch, heads, head_dim, dtype=dtype)
    return query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32)


def contiguous_padded(query, lens, head_dim):
    batch, heads, _ = query.shape
    length = int(lens.max())
    keys = torch.randn(batch, heads, length, head_dim, dtype=query.dtype)
    values = torch.randn(batch, heads, length, head_dim, dtype=query.dtype)
    mask = (torch.arange(length) < lens.long()[:, None])[:, None, None, :]
    return lambda: F.scaled_dot_product_attention(query[:, :, None], keys, values, attn_mask=mask)


def layer_caches(
    batch: int, layers: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> list[tuple]:
    """``layers`` cases sharing the query, block tables and lengths, each with its own caches."""
    first = make_case(batch, heads, kv_heads, head_dim, block_size, seed=0, dtype=dtype)
    query, key_cache, _, tables, lens = first
    more = [(query, torch.randn_like(key_cache), torch.randn_like(key_cache), tables, lens) for _ in range(1, layers)]
    return [first, *more]


def run_batch(batch: int, block_size: int, args: argparse.Namespace, threads: int) -> None:
    heads, kv_heads, head_dim = args.heads, args.kv_heads or args.heads, args.head_dim
    scale = head_dim**-0.5
    dtype = getattr(torch, args.dtype)
    layers = layer_caches(batch, args.layers, heads, kv_heads, head_dim, block_size, dtype)
    if args.kv_cache_dtype != "auto":  # NOTE: the same values, stored 8-bit (kernels/kv_quant.py)
        stored = CACHE_DTYPE_OF[args.kv_cache_dtype]
        layers = [(q, quantize(kc, stored), quantize(vc, stored), t, n) for q, kc, vc, t, n in layers]
    query, key_cache, _, tables, lens = layers[0]
    kv_bytes = int(lens.sum()) * kv_heads * key_cache.shape[-1] * key_cache.element_size() * 2
    print(
        f"batch {batch}, {args.dtype} (cache {args.kv_cache_dtype}), blocks of {block_size} tokens: "
        f"mean context {lens.float().mean():.0f}, "
        f"longest {int(lens.max())}, {threads} thread(s), {args.layers} cache(s), "
        f"{kv_bytes / 1e6:.1f} MB of K/V per call; per call:"
    )

    def timed(label: str, fn) -> None:
        ms = median_ms(lambda: [fn(*case) for case in layers], args.repeats) / len(layers)
        print(f"  {label:44s} {ms:8.2f} ms  {kv_bytes / ms / 1e6:6.1f} GB/s")

    if args.variants == "all":
        timed(
            "reference (pad to longest)",
            lambda q, kc, vc, t, n: paged_decode_attention_reference(q, kc, vc, t, n, scale),
        )
        empty = (torch.zeros(0, 0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
        empty += (torch.zeros(0, dtype=torch.int32),)
        for pad in args.pad_tokens:
            plan = cpu_attention.plan_attention(tables, lens, *empty, block_size, max_pad_tokens=pad)
            label = f"planned, pad <= {pad} tokens ({len(plan.grouped().groups)} groups)"
            timed(label, lambda q, kc, vc, t, n, plan=plan: cpu_attention.decode_attention(q, kc, vc, plan, scale))
    timed("compiled kernel (numba backend)", lambda q, kc, vc, t, n: paged_decode_attention_cpu(q, kc, vc, t, n, scale))
    if args.variants == "all" and kv_heads == heads:
        floor = contiguous_padded(query, lens, head_dim)
        print(f"  {'contiguous K/V padded to the longest':44s} {median_ms(floor, args.repeats):8.2f} ms")
    # NOTE: what the memory allows: the same bytes per layer, read once in order (no attention).
    streams = [torch.randn(kv_bytes // 4) for _ in layers]
    ms = median_ms(lambda: [x.sum() for x in streams], args.repeats) / len(streams)
    print(f"  {'memory: sum() of as many bytes, in order':44s} {ms:8.2f} ms  {kv_bytes / ms / 1e6:6.1f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cpu_attention", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPU quota)")
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64], help="decoding sequences")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64], help="tokens per KV cache block")
    parser.add_argument("--pad-tokens", type=int, nargs="+", default=[0, 32, 64, 100000], help="grouping thresholds")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per variant (median reported)")
    parser.add_argument("--layers", type=int, default=1, help="distinct caches cycled through (see the NOTE)")
    parser.add_argument("--heads", type=int, default=8, help="query heads (Qwen2.5-0.5B: 14)")
    parser.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: --heads; Qwen2.5-0.5B: 2)")
    parser.add_argument("--head-dim", type=int, default=64, help="head size")
    parser.add_argument("--variants", default="all", choices=("all", "kernel"), help="kernel: the compiled kernel only")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="cache dtype")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="auto: --dtype; else 8-bit")
    args = parser.parse_args()
    threads = set_threads(args.threads)
    for batch in args.batch:
        for block_size in args.block_sizes:
            run_batch(batch, block_size, args, threads)


if __name__ == "__main__":
    main()
