"""CPU prefill attention, one layer, one prompt with no cached prefix: the torch backend's
SDPA (causal, over the prompt's own K/V, as cpu_attention.py runs it for other dtypes) against
the C flash-attention kernel the engine takes for bfloat16 (kernels/prefill_attention_cpu.py),
which reads K/V from the paged cache through the block table. With ``--kv-cache-dtype`` the
kernel also runs over 8-bit caches holding the same K/V (kernels/kv_quant.py; fp8 at scale
1.0), each timed beside the bfloat16 one (SDPA attends to the prompt's own K/V whatever the
cache holds: the torch path's prefill of a chunk without a cached prefix).

GFLOP/s count causal FLOPs only: 4 * heads * head_dim * T (T + 1) / 2 (QK^T and P·V over
the positions each query sees). The default shape is Qwen2.5-0.5B's attention (14 query
heads over 2 KV heads of 64), blocks of 16 tokens scattered over the cache.

    python -m benchmarks.cpu_prefill_attention --threads 2 --tokens 256 512 1024 2048
    python -m benchmarks.cpu_prefill_attention --threads 1 --tokens 512 2048 --kv-cache-dtype auto int8 fp8
"""

from __future__ import annotations

import argparse
import functools

import torch

from benchmarks.common import HelpFormatter, set_threads
from benchmarks.cpu_attention import median_ms
from pagedllm.kernels.kv_quant import CACHE_DTYPE_OF, cache_dtype, row_width, write_rows
from pagedllm.kernels.prefill_attention_cpu import applies, prefill_attention_cpu
from pagedllm.server.worker import cpu_attention


def causal_flops(tokens: int, heads: int, head_dim: int) -> float:
    return 4.0 * heads * head_dim * tokens * (tokens + 1) / 2


def make_case(
    tokens: int, heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int = 0, kv_cache_dtype: str = "auto"
):
    """A prompt's q/k/v in bfloat16 and a cache (``kv_cache_dtype``: its rows quantized) holding
    its K/V in blocks scattered at random."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=gen).to(torch.bfloat16) for _ in range(2))
    num_blocks = -(-tokens // block_size)
    table = torch.randperm(4 * num_blocks, generator=gen)[:num_blocks].to(torch.int32)
    dtype = cache_dtype(kv_cache_dtype, torch.bfloat16)
    shape = (4 * num_blocks, block_size, kv_heads, row_width(dtype, head_dim))
    caches = [torch.zeros(shape, dtype=dtype) for _ in range(2)]
    slots = (table.long()[:, None] * block_size + torch.arange(block_size)).flatten()[:tokens]
    for cache, new in zip(caches, (k, v)):
        write_rows(cache, slots, new)
    return q, k, v, caches[0], caches[1], table[None]


def run(tokens: int, args: argparse.Namespace) -> None:
    heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
    scale = head_dim**-0.5
    q, k, v, *_ = make_case(tokens, heads, kv_heads, head_dim, args.block_size)
    qt, kt, vt = (x.transpose(0, 1) for x in (q, k, v))

    def sdpa():
        return cpu_attention._attend(qt, kt, vt, None, scale, None, causal=True)

    flops = causal_flops(tokens, heads, head_dim)
    report(tokens, "sdpa", median_ms(sdpa, args.repeats), flops)
    for name in args.kv_cache_dtype:
        *_, key_cache, value_cache, tables = make_case(
            tokens, heads, kv_heads, head_dim, args.block_size, kv_cache_dtype=name
        )
        ours = functools.partial(prefill_attention_cpu, q, key_cache, value_cache, tables, [(0, tokens, tokens)], scale)
        label = "c kernel" if name == "auto" else f"c {name}"
        report(tokens, label, median_ms(ours, args.repeats), flops)
        error = (ours().float() - sdpa().transpose(0, 1).float()).abs().max().item()
        print(f"{tokens:>6} max |{label} - sdpa| = {error:.3g}")


def report(tokens: int, label: str, ms: float, flops: float) -> None:
    print(f"{tokens:>6} {label:<12} {ms:9.3f} ms  {flops / ms / 1e6:7.1f} GFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch/Numba threads (default: the CPU quota)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["auto"],
        choices=["auto", *CACHE_DTYPE_OF],
        help="caches the C kernel reads (auto: bfloat16)",
    )
    args = parser.parse_args()
    set_threads(args.threads)
    probe = torch.zeros(1, args.heads, args.head_dim, dtype=torch.bfloat16)
    if not applies(probe, torch.zeros(1, args.block_size, args.kv_heads, args.head_dim, dtype=torch.bfloat16)):
        raise SystemExit("the C prefill attention does not run here (AVX-512-BF16, numba, a C compiler) or this shape")
    for tokens in args.tokens:
        run(tokens, args)


if __name__ == "__main__":
    main()
