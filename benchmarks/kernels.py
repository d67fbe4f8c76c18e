"""Decode-attention benchmark: the paged Triton kernel against torch SDPA on the same K/V
stored contiguously, and against the GPU's measured device-to-device copy bandwidth.

One command on a CUDA machine (writes benchmarks/results/kernels_<date>_<device>.{csv,md}):

    python -m benchmarks.kernels            # full sweep: batch 1..256, context 512..8k
    python -m benchmarks.kernels --quick    # a few points, a minute or so
    python -m benchmarks.kernels --list     # print the sweep and exit (no GPU needed)

Per configuration (all sequences of one batch share the context length, so the
contiguous baseline is exact):
  latency_us      median of triton.testing.do_bench (or CUDA-graph replays, --timer cudagraph)
  bandwidth       bytes / latency with bytes = 2 (K and V) * sum(len) * kv_heads * head_dim * 2 B
  frac_copy_bw    bandwidth / copy bandwidth, the latter = 2 * N bytes (read + write) over the
                  median time of a N-byte device-to-device ``copy_`` measured in the same run
  ratio_vs_sdpa   our latency / SDPA latency (< 1: faster than contiguous SDPA)
Goals: ratio_vs_sdpa <= 1.10 and frac_copy_bw >= 0.80 at batch >= 32, context >= 2k.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import math
import re
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.common import HelpFormatter

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Config:
    batch: int
    context_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def kv_bytes(self, element_size: int) -> int:
        """Bytes of K and V the decode step must read: 2 * sum(len) * kv_heads * head_dim * elem."""
        return 2 * self.batch * self.context_len * self.num_kv_heads * self.head_dim * element_size


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32, 64, 128, 256], help="comma-separated batch sizes")
    p.add_argument(
        "--context-lens",
        type=_ints,
        default=[512, 1024, 2048, 4096, 8192],
        help="comma-separated context lengths in tokens",
    )
    p.add_argument("--num-heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=_ints, default=[8, 32], help="KV heads (8: GQA, 32: MHA)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension")
    p.add_argument(
        "--block-sizes", type=_ints, default=[8, 16, 32, 128], help="comma-separated KV block sizes in tokens"
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="KV and query dtype")
    p.add_argument(
        "--timer",
        choices=["do_bench", "cudagraph"],
        default="do_bench",
        help="triton.testing timer: do_bench or CUDA-graph replay",
    )
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench measurement time per point (ms)")
    p.add_argument(
        "--mem-fraction",
        type=float,
        default=0.8,
        help="skip points whose paged + contiguous K/V exceed this fraction of free GPU memory",
    )
    p.add_argument("--quick", action="store_true", help="batch 1,32,128 x context 512,4096 x block 16")
    p.add_argument("--list", action="store_true", help="print the sweep and exit")
    p.add_argument(
        "--out-dir", type=Path, default=RESULTS_DIR, help="directory the CSV and JSON results are written to"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.context_lens, args.block_sizes = [1, 32, 128], [512, 4096], [16]
    for kv in args.kv_heads:
        if kv < 1 or args.num_heads % kv:
            p.error(f"--kv-heads {kv} must divide --num-heads {args.num_heads}")
    if not 0 < args.mem_fraction <= 1:
        p.error(f"--mem-fraction must be in (0, 1], got {args.mem_fraction}")
    return args


def sweep(args: argparse.Namespace) -> list[Config]:
    return [
        Config(batch, ctx, args.num_heads, kv, args.head_dim, bs)
        for kv, bs, ctx, batch in itertools.product(
            args.kv_heads, args.block_sizes, args.context_lens, args.batch_sizes
        )
    ]


def require_cuda() -> None:
    if not torch.cuda.is_available():
        sys.exit(
            "benchmarks/kernels.py measures GPU kernels and needs a CUDA device; none is visible "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}). "
            "Run it on a GPU machine, or use --list to see the sweep."
        )
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/kernels.py needs Triton: pip install 'pagedllm[triton]'")


def make_inputs(cfg: Config, dtype: torch.dtype, device: str):
    """Paged K/V with a shuffled block table (a fragmented cache), and its query."""
    blocks_per_seq = math.ceil(cfg.context_len / cfg.block_size)
    num_blocks = cfg.batch * blocks_per_seq
    shape = (num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(cfg.batch, blocks_per_seq)
    context_lens = torch.full((cfg.batch,), cfg.context_len, dtype=torch.int32, device=device)
    query = torch.randn(cfg.batch, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
    return query, key_cache, value_cache, block_tables, context_lens


def contiguous_kv(cache: torch.Tensor, block_tables: torch.Tensor, context_len: int) -> torch.Tensor:
    """The same K (or V) stored contiguously: [batch, kv_heads, context_len, head_dim]."""
    batch = block_tables.shape[0]
    _, block_size, kv_heads, head_dim = cache.shape
    out = torch.empty(batch, kv_heads, context_len, head_dim, dtype=cache.dtype, device=cache.device)
    chunk = max(1, 2**28 // max(1, context_len * kv_heads * head_dim))  # bound the gather's temporary
    for start in range(0, batch, chunk):
        blocks = cache[block_tables[start : start + chunk].long()]  # [chunk, blocks, bs, kv_heads, d]
        seqs = blocks.flatten(1, 2)[:, :context_len]  # [chunk, len, kv_heads, d]
        out[start : start + chunk] = seqs.permute(0, 2, 1, 3)
    return out


def timer(kind: str, rep_ms: int):
    import triton.testing

    if kind == "cudagraph":
        return lambda fn: triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
    return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def measure_copy_bandwidth(bench, device: str, nbytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)


def bench_config(cfg: Config, dtype: torch.dtype, bench, copy_bw: float, mem_fraction: float) -> dict:
    from pagedllm.kernels import paged_decode_attention

    row = asdict(cfg)
    kv_bytes = cfg.kv_bytes(torch.finfo(dtype).bits // 8)
    free, _ = torch.cuda.mem_get_info()
    if 2 * kv_bytes > mem_fraction * free:
        return row | {"status": f"skipped: needs {2 * kv_bytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"}
    query, key_cache, value_cache, block_tables, context_lens = make_inputs(cfg, dtype, "cuda")
    scale = cfg.head_dim**-0.5
    ours = bench(lambda: paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale))
    out = paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale)
    k = contiguous_kv(key_cache, block_tables, cfg.context_len)
    v = contiguous_kv(value_cache, block_tables, cfg.context_len)
    del key_cache, value_cache
    q = query.unsqueeze(2)  # [batch, heads, 1, head_dim]
    gqa = cfg.num_heads != cfg.num_kv_heads

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)

    baseline = bench(sdpa)
    max_err = (sdpa().squeeze(2).float() - out.float()).abs().max().item()
    del k, v
    torch.cuda.empty_cache()
    bandwidth = kv_bytes / (ours * 1e-3)
    return row | {
        "status": "ok",
        "latency_us": round(ours * 1e3, 2),
        "sdpa_latency_us": round(baseline * 1e3, 2),
        "ratio_vs_sdpa": round(ours / baseline, 3),
        "bandwidth_gbs": round(bandwidth / 1e9, 1),
        "frac_copy_bw": round(bandwidth / copy_bw, 3),
        "max_abs_err_vs_sdpa": f"{max_err:.2e}",
    }


COLUMNS = [
    "batch",
    "context_len",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "block_size",
    "status",
    "latency_us",
    "sdpa_latency_us",
    "ratio_vs_sdpa",
    "bandwidth_gbs",
    "frac_copy_bw",
    "max_abs_err_vs_sdpa",
]


def summarize(rows: list[dict]) -> list[str]:
    """Goal check over the target region: batch >= 32, context >= 2k."""
    region = [r for r in rows if r["status"] == "ok" and r["batch"] >= 32 and r["context_len"] >= 2048]
    if not region:
        return ["no measured point has batch >= 32 and context >= 2048"]
    ratios = [r["ratio_vs_sdpa"] for r in region]
    fracs = [r["frac_copy_bw"] for r in region]
    return [
        f"points with batch >= 32, context >= 2048: {len(region)}",
        f"latency / contiguous SDPA: median {statistics.median(ratios):.3f}, worst {max(ratios):.3f} (goal <= 1.10)",
        f"fraction of copy bandwidth: median {statistics.median(fracs):.3f}, worst {min(fracs):.3f} (goal >= 0.80)",
        f"points meeting both goals: {sum(r <= 1.10 and f >= 0.80 for r, f in zip(ratios, fracs))} of {len(region)}",
    ]


def write_results(rows: list[dict], meta: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", meta["device"]).strip("-").lower()
    stem = out_dir / f"kernels_{meta['date']}_{slug}"
    csv_path, md_path = stem.with_suffix(".csv"), stem.with_suffix(".md")
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, restval="")
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"# Paged decode attention, {meta['device']}, {meta['date']}", ""]
    lines += [f"- {key}: {value}" for key, value in meta.items()]
    lines += ["", "## Summary", ""] + [f"- {line}" for line in summarize(rows)]
    lines += ["", "## All points", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |" for r in rows]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configs = sweep(args)
    if args.list:
        print(f"{len(configs)} configurations:")
        for cfg in configs:
            print(f"  {cfg}")
        return
    require_cuda()
    import triton
    from tqdm import tqdm

    dtype = DTYPES[args.dtype]
    bench = timer(args.timer, args.rep_ms)
    copy_bw = measure_copy_bandwidth(bench, "cuda")
    meta = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "timer": f"{args.timer} (median)",
        "copy_bandwidth_gbs": f"{copy_bw / 1e9:.0f} (read + write of a 1 GiB copy_)",
    }
    print(f"{meta['device']}: device-to-device copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    rows = [bench_config(cfg, dtype, bench, copy_bw, args.mem_fraction) for cfg in tqdm(configs, desc="decode")]
    csv_path, md_path = write_results(rows, meta, args.out_dir)
    print("\n".join(summarize(rows)))
    print(f"wrote {csv_path} and {md_path}")


if __name__ == "__main__":
    main()
