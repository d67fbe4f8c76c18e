"""Paging vs reservation at equal memory: KV waste (Figs. 2, 13), latency vs rate (Figs. 12, 17)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import matplotlib.pyplot as plt
import numpy as np
from tqdm import tqdm

from benchmarks.budget_baselines import hf_continuous_capacity, hf_static_online, measured_batch, roofline_batch
from benchmarks.hf_baselines import _load
from benchmarks.paper_setting import Context, save
from benchmarks.sim import ReplayResult, Roofline, replay
from benchmarks.workloads import Request
from pagedllm.server import SamplingParams

ALLOCATORS = ("paged", "oracle", "pow2", "max")
LABELS = {
    "paged": "PagedLLM (paged)",
    "oracle": "Orca (Oracle)",
    "pow2": "Orca (Pow2)",
    "max": "Orca (Max)",
    "hf-static": "transformers static batches",
    "hf-continuous": "transformers continuous (capacity)",
}
PAPER_WASTE = {"paged": 3.7, "oracle": 61.8, "pow2": 73.2, "max": 79.6}  # 100 - token states, Fig. 2


def greedy(requests: Sequence[Request]) -> Callable[[int], SamplingParams]:
    return lambda i: SamplingParams(temperature=0, max_tokens=requests[i].output_len, ignore_eos=True)


CLOCKS = {"measured": None, "roofline": Roofline()}
# A rate is sustained while normalized latency stays under this multiple of a lone request's.
# NOTE: set above what batching alone costs a request at these batch sizes, so that crossing it
# means a queue is building: on the roofline a step of ~50 sequences costs ~1.5x a lone one;
# measured on CPU the engine's per-sequence work makes it ~3x.
LATENCY_BOUND = {"measured": 4.0, "roofline": 2.0}
# Rates above this multiple of the all-at-once capacity are not tried (see sweep). The
# roofline's capacity underestimates more: its steps barely slow down as the batch grows,
# so a trace's tail, a few long requests alone, weighs more.
SKIP_OVER = {"measured": 3.0, "roofline": 10.0}


def serve(ctx: Context, workload: str, allocator: str, requests, arrivals, **kw) -> ReplayResult:
    engine = ctx.engine(workload, kv_reservation=allocator)
    prompts = [r.prompt_token_ids for r in requests]
    final = [len(r.prompt_token_ids) + r.output_len for r in requests]
    return replay(engine, prompts, arrivals, greedy(requests), final_len=final, **kw)


# -- Figs. 2 and 13 ---------------------------------------------------------------------
def fig13(ctx: Context) -> dict:
    """All requests at once: KV split and running requests over the steps where memory decided.

    With an 8-bit cache every allocator gets the blocks the same memory holds and the load grows
    as much (see :meth:`Context.memory_bound_requests`); the reference row ``paged-auto``, the
    paged engine with the model's own cache format, serves the profile's load, drawn alike: both
    queue the same number of cache-fulls of requests, so memory decides for as many turnovers.
    """
    result: dict = {"method": "all requests queued at t=0; averages over memory-bound steps (see sim.py)"}
    quantized = ctx.kv_cache_dtype != "auto"
    for workload in ("sharegpt", "alpaca"):
        requests = ctx.requests(workload, ctx.memory_bound_requests(workload))
        rows, tokens = {}, {}
        for allocator in tqdm(ALLOCATORS, desc=f"fig13 {workload}"):
            run = serve(ctx, workload, allocator, requests, [0.0] * len(requests), keep_tokens=True)
            rows[allocator] = {**run.mean_over_bound_steps(), "paper_waste_pct": PAPER_WASTE[allocator]}
            tokens[allocator] = run.tokens
        if quantized:
            rows["paged-auto"] = _auto_row(ctx, workload)
        _warn_unbound(workload, rows)
        same = all(tokens[a] == tokens["paged"] for a in ALLOCATORS)
        result[workload] = {
            "budget_blocks": ctx.profile.budget_blocks[workload],
            "kv_blocks": ctx.engine_config(workload).cache.num_gpu_blocks_override,
            "num_requests": len(requests),
            "allocators": rows,
            "identical_greedy_tokens": same,
        }
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for col, workload in enumerate(("sharegpt", "alpaca")):
        _waste_bars(axes[2 * col], result[workload]["allocators"], workload)
        _running_bars(axes[2 * col + 1], result[workload]["allocators"], workload)
    save("fig13", ctx, result, fig)
    return result


def _auto_row(ctx: Context, workload: str) -> dict:
    """The paged engine with the model's own cache format on the profile's load (see fig13)."""
    auto = dataclasses.replace(ctx, kv_cache_dtype="auto")
    requests = auto.requests(workload)
    row = serve(auto, workload, "paged", requests, [0.0] * len(requests)).mean_over_bound_steps()
    blocks = auto.engine_config(workload).cache.num_gpu_blocks_override
    return row | {"num_requests": len(requests), "kv_blocks": blocks}


def _warn_unbound(workload: str, rows: dict) -> None:
    for name, row in rows.items():
        if row["memory_bound_steps"] == 0:
            print(f"fig13 {workload} {name}: memory never decided; its averages cover every step")


def _waste_bars(ax, rows: dict, workload: str) -> None:
    bottom = np.zeros(len(ALLOCATORS))
    for part, color in (("used", "tab:green"), ("reserved", "tab:orange"), ("internal", "tab:red"), ("free", "0.7")):
        values = np.array([rows[a][f"{part}_pct"] for a in ALLOCATORS])
        ax.bar(ALLOCATORS, values, bottom=bottom, color=color, label=part)
        bottom += values
    ax.set_title(f"KV slots, {workload}-like (%)")
    ax.legend(fontsize=7, loc="lower right")


def _running_bars(ax, rows: dict, workload: str) -> None:
    names = [a for a in (*ALLOCATORS, "paged-auto") if a in rows]
    ax.bar(names, [rows[a]["running"] for a in names], color="tab:blue")
    ax.set_title(f"running requests, {workload}-like")


# -- Fig. 12 ----------------------------------------------------------------------------
Measure = Callable[[float], tuple[float, float]]  # rate -> (normalized latency, simulated duration)


def sweep(measure: Measure, rates: Sequence[float], bound: float, num: int, desc: str, skip_over: float) -> dict:
    """Normalized latency from the highest useful rate down to the first under the bound.

    NOTE: a run costs about as long as its arrivals span on the simulated clock, so the
    sweep goes downwards and stops just below the knee. It starts with every request at
    once, which gives the capacity (requests/s); rates over ``skip_over`` x that are skipped
    (over the bound whenever the all-at-once run is; a finite trace's tail makes the
    capacity underestimate what a steady load sustains, hence the margin), and fractions
    of it are tried when no rate of the grid is low enough.
    """
    at_once, duration = measure(math.inf)
    capacity = num / duration
    points: list[tuple[float, float]] = []
    if at_once > bound:
        grid = [r for r in rates if r <= skip_over * capacity] + [f * capacity for f in (0.8, 0.5, 0.25, 0.1)]
        for rate in tqdm(sorted(set(grid), reverse=True), desc=desc):
            latency, _ = measure(rate)
            points.append((rate, latency))
            if latency <= bound:
                break
    return {"points": sorted(points), "capacity": capacity, "latency_all_at_once": at_once}


def sustainable_rate(curve: dict, bound: float) -> dict:
    """The highest rate under the bound, interpolated between the last rate under it and the first over."""
    if curve["latency_all_at_once"] <= bound:
        return {"rate": curve["capacity"], "note": "lower bound: under the bound with every request at once"}
    points = curve["points"]
    under = [p for p in points if p[1] <= bound]
    if not under:
        return {"rate": 0.0, "note": f"over the bound at every rate tried, down to {points[0][0]:.3g}"}
    r1, l1 = under[-1]
    over = [p for p in points if p[1] > bound and p[0] > r1]
    if not over:
        return {"rate": r1, "note": "lower bound: under the bound at every rate tried"}
    r2, l2 = over[0]
    return {"rate": r1 + (bound - l1) / (l2 - l1) * (r2 - r1), "note": "interpolated"}


def _served(ctx: Context, workload: str, allocator: str, requests, clock: str) -> Measure:
    def measure(rate: float) -> tuple[float, float]:
        run = serve(ctx, workload, allocator, requests, ctx.arrivals(len(requests), rate), roofline=CLOCKS[clock])
        return run.normalized_latency, run.duration

    return measure


def latency_bound(ctx: Context, workload: str, requests, clock: str) -> float:
    """``LATENCY_BOUND`` times the normalized latency of a few requests served one at a time."""
    alone = requests[:5]
    arrivals = [1e4 * i for i in range(len(alone))]  # far apart: each runs alone
    run = serve(ctx, workload, "paged", alone, arrivals, roofline=CLOCKS[clock])
    return LATENCY_BOUND[clock] * run.normalized_latency


def fig12(ctx: Context) -> dict:
    """One JSON and PNG per clock (``fig12-<profile>-<clock>``), or per clock and workload
    when ``--workloads`` names one (``fig12-<profile>-<clock>-<workload>``)."""
    results = {}
    workloads = ctx.workloads
    for clock in ctx.clocks:
        bound = f"{LATENCY_BOUND[clock]}x a lone request's normalized latency"
        result: dict = {"clock": clock, "latency_bound": bound}
        fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
        for ax, workload in zip(axes[0], workloads):
            data = result[workload] = _fig12_workload(ctx, workload, clock)
            _plot_curves(ax, data, data["latency_bound"], f"{workload}-like, {clock} clock")
        variant = clock if len(workloads) == 2 else f"{clock}-{workloads[0]}"
        results[clock] = save("fig12", ctx, result, fig, variant)
    return results


def _fig12_workload(ctx: Context, workload: str, clock: str) -> dict:
    requests, rates = ctx.requests(workload), ctx.profile.rates[clock][workload]
    bound = latency_bound(ctx, workload, requests, clock)
    curves = {}
    for allocator in ALLOCATORS:
        measure = _served(ctx, workload, allocator, requests, clock)
        curves[allocator] = sweep(
            measure, rates, bound, len(requests), f"fig12 {clock} {workload} {allocator}", SKIP_OVER[clock]
        )
    extra = {}
    if ctx.profile.hf_baselines:
        model, budget = _load(ctx.model_dir), ctx.budget_tokens(workload)
        batch_seconds = measured_batch(model) if clock == "measured" else roofline_batch(CLOCKS[clock])
        curves["hf-static"] = sweep(
            lambda r: hf_static_online(batch_seconds, requests, ctx.arrivals(len(requests), r), budget),
            rates,
            bound,
            len(requests),
            f"fig12 {clock} {workload} hf-static",
            SKIP_OVER[clock],
        )
    if ctx.profile.hf_baselines and clock == "measured":
        extra["hf-continuous"] = {
            "rate": hf_continuous_capacity(
                ctx.model_dir, requests, budget, ctx.profile.block_size, ctx.token_budget(workload)
            ),
            "note": "offline capacity (requests/s, all queued at once): an upper bound on its sustainable rate",
        }
    sustained = {name: sustainable_rate(points, bound) for name, points in curves.items()} | extra
    ours = sustained["paged"]["rate"]
    ratios = {name: round(ours / s["rate"], 2) if s["rate"] else None for name, s in sustained.items()}
    return {"budget_blocks": ctx.profile.budget_blocks[workload], "latency_bound": bound, "curves": curves} | {
        "sustainable_rate": sustained,
        "paged_over": ratios,
    }


def _plot_curves(ax, data: dict, bound: float, title: str) -> None:
    for name, curve in data["curves"].items():
        points = curve["points"] or [(curve["capacity"], curve["latency_all_at_once"])]
        rates, latencies = zip(*points)
        ax.plot(rates, latencies, marker="o", label=LABELS.get(name, name))
    if "hf-continuous" in data["sustainable_rate"]:
        ax.axvline(data["sustainable_rate"]["hf-continuous"]["rate"], ls=":", color="k", label=LABELS["hf-continuous"])
    ax.axhline(bound, ls="--", color="0.5", label="latency bound")
    ax.set_ylim(0, 3 * bound)
    ax.set_xlabel("request rate (req/s, simulated clock)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(title)
    ax.legend(fontsize=7)


# -- Fig. 17 ----------------------------------------------------------------------------
def chatbot_requests(ctx: Context) -> list[Request]:
    """Turns of synthetic conversations: the prompt is the whole history plus the new user
    message, truncated to its last 1024 tokens; turn lengths follow the ShareGPT-like samplers."""
    rng = np.random.default_rng(ctx.seed)
    turns = ctx.requests("sharegpt", 4 * ctx.profile.num_requests["chatbot"])
    requests, history, cursor = [], [], 0
    while len(requests) < ctx.profile.num_requests["chatbot"]:
        if not history or rng.random() < 0.3:  # a new conversation
            history = []
        turn = turns[cursor]
        cursor += 1
        prompt = (history + turn.prompt_token_ids)[-ctx.profile.max_input :]
        requests.append(Request(prompt, turn.output_len))
        history = prompt + rng.integers(0, ctx.vocab, turn.output_len).tolist()
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


def fig17(ctx: Context) -> dict:
    requests = chatbot_requests(ctx)
    result: dict = {
        "budget_blocks": ctx.profile.budget_blocks["chatbot"],
        "mean_prompt": float(np.mean([len(r.prompt_token_ids) for r in requests])),
        "mean_output": float(np.mean([r.output_len for r in requests])),
    }
    results = {}
    for clock in ctx.clocks:
        fig, ax = plt.subplots(figsize=(6, 4))
        data = _fig17_clock(ctx, requests, clock)
        _plot_curves(ax, data, data["latency_bound"], f"chatbot (history <= 1024 tokens), {clock} clock")
        results[clock] = save("fig17", ctx, {**result, "clock": clock, **data}, fig, clock)
    return results


def _fig17_clock(ctx: Context, requests, clock: str) -> dict:
    bound = latency_bound(ctx, "chatbot", requests, clock)
    rates = ctx.profile.rates[clock]["chatbot"]
    curves = {
        a: sweep(
            _served(ctx, "chatbot", a, requests, clock),
            rates,
            bound,
            len(requests),
            f"fig17 {clock} {a}",
            SKIP_OVER[clock],
        )
        for a in ALLOCATORS
    }
    sustained = {a: sustainable_rate(points, bound) for a, points in curves.items()}
    ours = sustained["paged"]["rate"]
    return {
        "latency_bound": bound,
        "curves": curves,
        "sustainable_rate": sustained,
        "paged_over": {a: round(ours / s["rate"], 2) if s["rate"] else None for a, s in sustained.items()},
    }


EXPERIMENTS = {"fig13": fig13, "fig12": fig12, "fig17": fig17}
