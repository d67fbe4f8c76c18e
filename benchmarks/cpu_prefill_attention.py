"""CPU prefill attention, one layer, one prompt with no cached prefix: the torch backend's
SDPA (causal, over the prompt's own K/V, as cpu_attention.py runs it for other dtypes) against
the C flash-attention kernel the engine takes for bfloat16 (kernels/prefill_attention_cpu.py),
which reads K/V from the paged cache through the block table.

GFLOP/s count causal FLOPs only: 4 * heads * head_dim * T (T + 1) / 2 (QK^T and P·V over
the positions each query sees). The default shape is Qwen2.5-0.5B's attention (14 query
heads over 2 KV heads of 64), blocks of 16 tokens scattered over the cache.

    python -m benchmarks.cpu_prefill_attention --threads 2 --tokens 256 512 1024 2048
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import HelpFormatter, set_threads
from pagedllm.kernels.prefill_attention_cpu import applies, prefill_attention_cpu
from pagedllm.server.worker import cpu_attention


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def causal_flops(tokens: int, heads: int, head_dim: int) -> float:
    return 4.0 * heads * head_dim * tokens * (tokens + 1) / 2


def make_case(tokens: int, heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int = 0):
    """A prompt's q/k/v in bfloat16 and a cache holding its K/V in blocks scattered at random."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=gen).to(torch.bfloat16) for _ in range(2))
    num_blocks = -(-tokens // block_size)
    table = torch.randperm(4 * num_blocks, generator=gen)[:num_blocks].to(torch.int32)
    caches = [torch.zeros(4 * num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16) for _ in range(2)]
    slots = (table.long()[:, None] * block_size + torch.arange(block_size)).flatten()[:tokens]
    for cache, new in zip(caches, (k, v)):
        cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, new)
    return q, k, v, caches[0], caches[1], table[None]


def run(tokens: int, args: argparse.Namespace) -> None:
    heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
    q, k, v, key_cache, value_cache, tables = make_case(tokens, heads, kv_heads, head_dim, args.block_size)
    scale = head_dim**-0.5
    qt, kt, vt = (x.transpose(0, 1) for x in (q, k, v))

    def sdpa():
        return cpu_attention._attend(qt, kt, vt, None, scale, None, causal=True)

    def ours():
        return prefill_attention_cpu(q, key_cache, value_cache, tables, [(0, tokens, tokens)], scale)

    flops = causal_flops(tokens, heads, head_dim)
    error = (ours().float() - sdpa().transpose(0, 1).float()).abs().max().item()
    for label, fn in (("sdpa", sdpa), ("c kernel", ours)):
        ms = median_ms(fn, args.repeats)
        print(f"{tokens:>6} {label:<9} {ms:9.3f} ms  {flops / ms / 1e6:7.1f} GFLOP/s")
    print(f"{tokens:>6} max |c kernel - sdpa| = {error:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch/Numba threads (default: the CPU quota)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    set_threads(args.threads)
    probe = torch.zeros(1, args.heads, args.head_dim, dtype=torch.bfloat16)
    if not applies(probe, torch.zeros(1, args.block_size, args.kv_heads, args.head_dim, dtype=torch.bfloat16)):
        raise SystemExit("the C prefill attention does not run here (AVX-512-BF16, numba, a C compiler) or this shape")
    for tokens in args.tokens:
        run(tokens, args)


if __name__ == "__main__":
    main()
