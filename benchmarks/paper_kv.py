"""The 8-bit KV cache as a row of the paper's latency-vs-rate figure (Fig. 12 style).

``fig12kv``: our paged engine with the model's own cache format (``paged-auto``) and with
``--kv-cache-dtype`` (``paged-<format>``) in the same memory (the 8-bit cache gets as many more
blocks as the budget's bytes hold, see :meth:`Context.kv_blocks_per_budget_block`), the
same Poisson arrivals, normalized latency against request rate and the highest rate each
sustains under the latency bound, per clock (:mod:`sim`). On the roofline clock an 8-bit
cache's step reads fewer KV bytes: LLaMA-7B's rows of 128 elements in the format's bytes.

    python -m benchmarks.paper fig12kv --dtype bfloat16 --kv-cache-dtype int8 --clocks roofline
"""

from __future__ import annotations

import dataclasses

import matplotlib.pyplot as plt
import torch

from benchmarks.paper_memory import CLOCKS, LATENCY_BOUND, SKIP_OVER, latency_bound, serve, sustainable_rate, sweep
from benchmarks.paper_setting import Context, save
from benchmarks.sim import Roofline
from pagedllm.kernels.kv_quant import cache_dtype, row_width

LLAMA_7B_HEAD_DIM = 128


def roofline_for(clock: str, kv_cache_dtype: str) -> Roofline | None:
    """The clock's roofline (None: measured) with KV rows in ``kv_cache_dtype``'s bytes."""
    roofline = CLOCKS[clock]
    if roofline is None or kv_cache_dtype == "auto":
        return roofline
    cache = cache_dtype(kv_cache_dtype, torch.float16)
    row_bytes = row_width(cache, LLAMA_7B_HEAD_DIM) * cache.itemsize
    scaled = roofline.kv_bytes_per_token * row_bytes // (LLAMA_7B_HEAD_DIM * 2)
    return dataclasses.replace(roofline, kv_bytes_per_token=scaled)


def extended_rates(rates: list[float]) -> list[float]:
    """The profile's rate grid and 1.5, 2, 3 and 4 times its top: more memory moves the knee up."""
    return sorted({*rates, *(f * max(rates) for f in (1.5, 2, 3, 4))})


def fig12kv(ctx: Context) -> dict:
    """Latency vs rate, 8-bit cache against the model's own, at equal memory; one file per clock."""
    if ctx.kv_cache_dtype == "auto":
        print("fig12kv compares an 8-bit cache with auto: skipped without --kv-cache-dtype")
        return {}
    auto = dataclasses.replace(ctx, kv_cache_dtype="auto")
    systems = {"paged-auto": auto, f"paged-{ctx.kv_cache_dtype}": ctx}
    results = {}
    for clock in ctx.clocks:
        result: dict = {"clock": clock, "latency_bound": f"{LATENCY_BOUND[clock]}x a lone request's normalized latency"}
        fig, axes = plt.subplots(1, len(ctx.workloads), figsize=(6 * len(ctx.workloads), 4), squeeze=False)
        for ax, workload in zip(axes[0], ctx.workloads):
            data = result[workload] = _workload(ctx, systems, workload, clock)
            _plot(ax, data, f"{workload}-like, {clock} clock")
        results[clock] = save("fig12kv", ctx, result, fig, clock)
    return results


def _workload(ctx: Context, systems: dict[str, Context], workload: str, clock: str) -> dict:
    requests = ctx.requests(workload, ctx.memory_bound_requests(workload))
    bound = latency_bound(systems["paged-auto"], workload, requests, clock)
    curves = {}
    for name, system in systems.items():
        roofline = roofline_for(clock, system.kv_cache_dtype)

        def measure(rate: float, system: Context = system, roofline: Roofline | None = roofline):
            arrivals = system.arrivals(len(requests), rate)
            run = serve(system, workload, "paged", requests, arrivals, roofline=roofline)
            return run.normalized_latency, run.duration

        rates = extended_rates(ctx.profile.rates[clock][workload])
        desc = f"fig12kv {clock} {workload} {name}"
        curves[name] = sweep(measure, rates, bound, len(requests), desc, SKIP_OVER[clock])
    sustained = {name: sustainable_rate(curve, bound) for name, curve in curves.items()}
    base = sustained["paged-auto"]["rate"]
    return {
        "budget_blocks": ctx.profile.budget_blocks[workload],
        "kv_blocks": {name: s.engine_config(workload).cache.num_gpu_blocks_override for name, s in systems.items()},
        "num_requests": len(requests),
        "latency_bound": bound,
        "curves": curves,
        "sustainable_rate": sustained,
        "over_auto": {name: round(s["rate"] / base, 2) if base else None for name, s in sustained.items()},
    }


def _plot(ax, data: dict, title: str) -> None:
    for name, curve in data["curves"].items():
        points = curve["points"] or [(curve["capacity"], curve["latency_all_at_once"])]
        rates, latencies = zip(*points)
        ax.plot(rates, latencies, marker="o", label=name)
    ax.axhline(data["latency_bound"], ls="--", color="0.5", label="latency bound")
    ax.set_ylim(0, 3 * data["latency_bound"])
    ax.set_xlabel("request rate (req/s, simulated clock)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(title)
    ax.legend(fontsize=7)


EXPERIMENTS = {"fig12kv": fig12kv}
