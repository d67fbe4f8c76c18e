"""What the offline throughput benchmark (benchmarks/throughput.py) makes of its runs: ours over each
other system (median and, for the engines run in turn with it, each repeat's), the requests whose
greedy tokens differ between our engine and vLLM, and the printed table."""

from __future__ import annotations

PEERS = ("vllm", "ours_plain")
"""The systems whose speed is quoted as ours over theirs run by run (:func:`run_ratios`)."""


def greedy_check(outputs: dict[str, list[list[int]]]) -> dict:
    """Requests whose greedy tokens differ between our engine and vLLM, and where the first few diverge."""
    if "ours" not in outputs or "vllm" not in outputs:
        return {}
    diverge = [
        {"request": i, "position": next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))}
        for i, (a, b) in enumerate(zip(outputs["ours"], outputs["vllm"]))
        if a != b
    ]
    print(f"  greedy tokens: {len(diverge)} of {len(outputs['ours'])} requests differ between ours and vLLM")
    return {"greedy_checked": len(outputs["ours"]), "greedy_mismatches": len(diverge), "first_divergences": diverge[:5]}


def ratios(rates: dict[str, float]) -> dict[str, float]:
    ours = rates.get("ours")
    if ours is None:
        return {}
    return {f"ours_over_{name}": ours / rate for name, rate in rates.items() if name != "ours"}


def run_ratios(runs: list[dict]) -> dict:
    """Ours over each of :data:`PEERS` in each repeat: the two ran minutes apart, so these drift least."""
    if not runs or "ours" not in runs[0]["tokens_per_s"]:
        return {}
    peers = [p for p in PEERS if p in runs[0]["tokens_per_s"]]
    return {
        f"ours_over_{p}_per_run": [run["tokens_per_s"]["ours"] / run["tokens_per_s"][p] for run in runs] for p in peers
    }


def table(result: dict) -> str:
    """The cases as a markdown table: median tokens/s of every system, ours over each (each run's
    ratio to vLLM in brackets), and CPU ms per output token where measured."""
    systems = result["systems"]
    others = [s for s in systems if s != "ours"] if "ours" in systems else []
    cpu = [s for s in systems if s in result["cases"][0].get("cpu_ms_per_token", {})] if result["cases"] else []
    head = ["outputs", "batch", "requests", *[f"{s} tok/s" for s in systems], *[f"ours/{s}" for s in others]]
    head += [f"{s} CPU ms/tok" for s in cpu]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in result["cases"]:
        cells = [case["workload"], str(case["batch_size"]), str(case["num_requests"])]
        cells += [f"{case['tokens_per_s'][s]:.1f}" for s in systems]
        for s in others:
            per_run = case.get(f"ours_over_{s}_per_run")
            spread = f" ({', '.join(f'{r:.2f}' for r in per_run)})" if per_run and len(per_run) > 1 else ""
            cells.append(f"{case[f'ours_over_{s}']:.2f}{spread}")
        cells += [f"{case['cpu_ms_per_token'][s]:.2f}" for s in cpu]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
