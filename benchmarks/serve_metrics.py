"""Serving metrics with ``vllm bench serve``'s definitions (see :mod:`serve` for what each means)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    success: bool = False
    error: str = ""


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    for name, values in (
        ("ttft", [r.ttft for r in ok]),
        ("tpot", tpots),
        ("itl", [x for r in ok for x in r.itl]),
        ("e2el", [r.latency for r in ok]),
    ):
        ms = np.array(values or [0.0]) * 1000
        summary.update(
            {
                f"mean_{name}_ms": float(ms.mean()),
                f"median_{name}_ms": float(np.median(ms)),
                f"std_{name}_ms": float(ms.std()),
                f"p99_{name}_ms": float(np.percentile(ms, 99)),
            }
        )
    errors = sorted({r.error for r in results if not r.success})
    summary["errors"] = errors[:5]
    return summary


def report(summary: dict, args) -> str:
    lines = [
        "============ Serving Benchmark Result ============",
        f"{'Successful requests:':<40}{summary['completed']:<10}",
        f"{'Failed requests:':<40}{summary['failed']:<10}",
        f"{'Request rate (req/s):':<40}{args.request_rate:<10}",
        f"{'Burstiness:':<40}{args.burstiness:<10}",
        f"{'Benchmark duration (s):':<40}{summary['duration_s']:<10.2f}",
        f"{'Total input tokens:':<40}{summary['total_input_tokens']:<10}",
        f"{'Total generated tokens:':<40}{summary['total_output_tokens']:<10}",
        f"{'Request throughput (req/s):':<40}{summary['request_throughput']:<10.2f}",
        f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:<10.2f}",
        f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:<10.2f}",
    ]
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for key, title in titles.items():
        lines.append(f"{'-' * 15}{title}{'-' * 15}")
        for stat in ("mean", "median", "p99"):
            lines.append(f"{f'{stat.capitalize()} {key.upper()} (ms):':<40}{summary[f'{stat}_{key}_ms']:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


def median_summary(summaries: list[dict]) -> dict:
    """Every numeric metric's median over ``summaries`` (runs of one server); errors pooled."""
    merged: dict = {}
    for key, value in summaries[0].items():
        if isinstance(value, (int, float)):
            merged[key] = float(np.median([s[key] for s in summaries]))
    merged["errors"] = sorted({e for s in summaries for e in s["errors"]})[:5]
    return merged


# (summary key, column title): what a comparison of servers shows side by side
COLUMNS = (
    ("request_throughput", "req/s"),
    ("output_throughput", "output tok/s"),
    ("mean_ttft_ms", "mean TTFT ms"),
    ("p99_ttft_ms", "P99 TTFT ms"),
    ("mean_tpot_ms", "mean TPOT ms"),
    ("median_itl_ms", "median ITL ms"),
    ("p99_itl_ms", "P99 ITL ms"),
    ("completed", "completed"),
)


def side_by_side(runs: list[dict], medians: dict[str, dict]) -> str:
    """A markdown table: each run (``{"server", "repeat", "summary"}``), each server's medians and,
    ours over each baseline run (``before``, ``vllm``; above 1 is better for throughput, worse for latencies)."""
    head = "| server | run | " + " | ".join(title for _, title in COLUMNS) + " |"
    lines = [head, "|---|---|" + "---|" * len(COLUMNS)]
    for run in runs:
        lines.append(_row(run["server"], str(run["repeat"] + 1), run["summary"]))
    if len(runs) > len(medians):
        lines += [_row(server, "median", summary) for server, summary in medians.items()]
    for other, title in (("before", "ours / before"), ("vllm", "ours / vLLM")):
        if {"ours", other} <= medians.keys():
            ours, base = medians["ours"], medians[other]
            ratios = [f"{ours[k] / base[k]:.2f}" if base[k] else "-" for k, _ in COLUMNS]
            lines.append(f"| {title} | median | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def _row(server: str, run: str, summary: dict) -> str:
    return f"| {server} | {run} | " + " | ".join(f"{summary[k]:.2f}" for k, _ in COLUMNS) + " |"
