"""What paging enables at equal memory: sharing (Fig. 14), prefix caching (Fig. 16), block size
(Fig. 18b) and preemption by swapping vs recomputing (Fig. 19)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from tqdm import tqdm

from benchmarks.paper_memory import greedy
from benchmarks.paper_setting import Context, save
from benchmarks.sim import replay
from benchmarks.unshared import UnsharedEngine
from benchmarks.workloads import Request
from pagedllm.server import SamplingParams
from pagedllm.server.engine.llm_engine import LLMEngine


def offline(engine: LLMEngine, requests, params_for) -> dict:
    """All requests queued at once: simulated seconds, requests/s, device blocks in use per step and
    per running sequence (when memory is the limit both runs fill the cache; per sequence they differ)."""
    blocks: list[int] = []
    seqs: list[int] = []

    def count(engine: LLMEngine) -> None:
        bm = engine.block_manager
        blocks.append(bm.gpu.num_blocks - bm.gpu.num_free)
        seqs.append(sum(len(g.unfinished_seqs()) for g in engine.scheduler.running))

    prompts = [r.prompt_token_ids for r in requests]
    run = replay(engine, prompts, [0.0] * len(requests), params_for, on_step=count)
    stats = engine.stats()
    return {
        "seconds": round(run.duration, 3),
        "requests_per_s": round(len(requests) / run.duration, 3),
        "normalized_latency": round(run.normalized_latency, 5),
        "mean_blocks_used": round(float(np.mean(blocks)), 1),
        "blocks_per_running_seq": round(sum(blocks) / max(1, sum(seqs)), 2),
        "preemptions": stats.num_preemptions,
        "prefix_cache_hit_pct": round(100 * stats.prefix_cache_hits / max(1, stats.prefix_cache_queries), 1),
    }


# -- Fig. 14 ----------------------------------------------------------------------------
def fig14(ctx: Context) -> dict:
    requests = ctx.requests("alpaca", ctx.profile.num_requests["alpaca"] // 4)
    rows = []
    for kind in ("parallel", "beam"):
        for k in tqdm((2, 4, 6), desc=f"fig14 {kind}"):
            row = {"method": kind, "k": k}
            for sharing, cls in (("shared", LLMEngine), ("unshared", UnsharedEngine)):
                row[sharing] = offline(ctx.engine("alpaca", cls), requests, _params(kind, k, requests))
            row["speedup"] = round(row["shared"]["requests_per_s"] / row["unshared"]["requests_per_s"], 2)
            per_seq = {s: row[s]["blocks_per_running_seq"] for s in ("shared", "unshared")}
            row["block_saving_pct"] = round(100 * (1 - per_seq["shared"] / per_seq["unshared"]), 1)
            rows.append(row)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, kind in zip(axes, ("parallel", "beam")):
        mine = [r for r in rows if r["method"] == kind]
        x = np.arange(len(mine))
        ax.bar(x - 0.2, [r["shared"]["requests_per_s"] for r in mine], 0.4, label="sharing (CoW)")
        ax.bar(x + 0.2, [r["unshared"]["requests_per_s"] for r in mine], 0.4, label="sharing disabled")
        ax.set_xticks(x, [f"{'n' if kind == 'parallel' else 'width'}={r['k']}" for r in mine])
        ax.set_ylabel("requests/s (simulated clock)")
        ax.set_title(f"{'parallel sampling' if kind == 'parallel' else 'beam search'}, Alpaca-like")
        ax.legend(fontsize=8)
    result = {"budget_blocks": ctx.profile.budget_blocks["alpaca"], "num_requests": len(requests), "rows": rows}
    save("fig14", ctx, result, fig)
    return result


def _params(kind: str, k: int, requests):
    if kind == "parallel":
        return lambda i: SamplingParams(
            n=k, temperature=1.0, seed=i, max_tokens=requests[i].output_len, ignore_eos=True
        )
    return lambda i: SamplingParams(
        use_beam_search=True, best_of=k, n=k, temperature=0, max_tokens=requests[i].output_len, ignore_eos=True
    )


# -- Fig. 16 ----------------------------------------------------------------------------
def prefix_requests(ctx: Context, prefix_len: int) -> list[Request]:
    """Translation-like requests (~20-token sentence in, ~20 out) behind one shared few-shot prefix."""
    rng = np.random.default_rng(ctx.seed + prefix_len)
    prefix = rng.integers(0, ctx.vocab, prefix_len).tolist()
    n = ctx.profile.num_requests["prefix"]
    lengths = np.clip(np.round(rng.lognormal(np.log(20), 0.4, (n, 2))), 4, min(64, ctx.profile.max_output)).astype(int)
    return [Request(prefix + rng.integers(0, ctx.vocab, a).tolist(), int(b)) for a, b in lengths]


def fig16(ctx: Context) -> dict:
    result = {"budget_blocks": ctx.profile.budget_blocks["prefix"], "paper_speedup_vs_oracle": {80: 1.67, 341: 3.58}}
    for prefix_len in (80, 341):
        requests = prefix_requests(ctx, prefix_len)
        runs = {
            state: offline(ctx.engine("prefix", enable_prefix_caching=state == "on"), requests, greedy(requests))
            for state in tqdm(("off", "on"), desc=f"fig16 prefix {prefix_len}")
        }
        runs["speedup"] = round(runs["on"]["requests_per_s"] / runs["off"]["requests_per_s"], 2)
        result[f"prefix_{prefix_len}"] = runs
    fig, ax = plt.subplots(figsize=(5, 3.6))
    x = np.arange(2)
    for dx, state in ((-0.2, "off"), (0.2, "on")):
        values = [result[f"prefix_{n}"][state]["requests_per_s"] for n in (80, 341)]
        ax.bar(x + dx, values, 0.4, label=f"prefix caching {state}")
    ax.set_xticks(x, ["one-shot (80 tokens)", "five-shot (341 tokens)"])
    ax.set_ylabel("requests/s (simulated clock)")
    ax.legend(fontsize=8)
    save("fig16", ctx, result, fig)
    return result


# -- Figs. 18b and 19 -------------------------------------------------------------------
def fig18(ctx: Context) -> dict:
    """Normalized latency at a fixed rate (about half of paging's sustainable one) per block size."""
    result: dict = {"backend": "torch reference attention (CPU); the Triton interpreter is too slow"}
    fig, ax = plt.subplots(figsize=(6, 4))
    for workload, rate in ctx.profile.block_size_rates.items():
        requests = ctx.requests(workload, ctx.profile.num_requests[workload] // 2)
        arrivals = ctx.arrivals(len(requests), rate)
        points = {}
        for bs in tqdm(ctx.profile.block_sizes, desc=f"fig18 {workload}"):
            engine = ctx.engine(workload, block_size=bs)
            points[bs] = replay(engine, [r.prompt_token_ids for r in requests], arrivals, greedy(requests))
        result[workload] = {
            "rate": rate,
            "normalized_latency": {bs: round(run.normalized_latency, 5) for bs, run in points.items()},
        }
        ax.plot(list(points), [run.normalized_latency for run in points.values()], marker="o", label=workload)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.legend()
    save("fig18", ctx, result, fig)
    return result


def fig19(ctx: Context) -> dict:
    """ShareGPT-like requests all at once into a cache holding a quarter of them: every run
    preempts; the overhead is the time over the same run's fastest mode."""
    requests = ctx.requests("sharegpt", ctx.profile.num_requests["sharegpt"] // 2)
    result: dict = {"swap": {}, "recompute": {}}
    for bs in tqdm(ctx.profile.block_sizes, desc="fig19"):
        for mode in ("swap", "recompute"):
            blocks = ctx.profile.preemption_budget_tokens // bs
            engine = ctx.engine("sharegpt", block_size=bs, preemption_mode=mode, num_gpu_blocks_override=blocks)
            result[mode][bs] = offline(engine, requests, greedy(requests))
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("swap", "recompute"):
        ax.plot(list(result[mode]), [r["seconds"] for r in result[mode].values()], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("time for all requests (s, simulated clock)")
    ax.legend()
    save("fig19", ctx, result, fig)
    return result


EXPERIMENTS = {"fig14": fig14, "fig16": fig16, "fig18": fig18, "fig19": fig19}
