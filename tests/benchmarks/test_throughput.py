"""The offline benchmark's comparison with vLLM: greedy agreement and the printed table."""

from __future__ import annotations

from benchmarks.throughput import greedy_check, ratios, run_ratios, table


def test_greedy_check_counts_requests_that_differ_and_where_they_first_diverge():
    ours = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1]]
    vllm = [[1, 2, 3], [4, 0, 6], [7, 8, 9], [1, 1]]
    assert greedy_check({"ours": ours, "vllm": vllm}) == {
        "greedy_checked": 4,
        "greedy_mismatches": 1,
        "first_divergences": [{"request": 1, "position": 1}],
    }
    assert greedy_check({"ours": ours, "vllm": ours})["greedy_mismatches"] == 0


def test_greedy_check_needs_both_engines():
    assert greedy_check({"ours": [[1]]}) == {}


def test_table_shows_medians_and_ours_over_vllm_with_each_runs_ratio():
    runs = [{"ours": 400.0, "vllm": 800.0}, {"ours": 600.0, "vllm": 600.0}]
    rates = {"ours": 500.0, "vllm": 700.0}
    case = dict(workload="fixed", batch_size=16, num_requests=32, tokens_per_s=rates, runs=runs)
    case |= ratios(rates) | run_ratios(runs)
    text = table({"systems": ["ours", "vllm"], "cases": [case]})
    assert text.splitlines() == [
        "| outputs | batch | requests | ours tok/s | vllm tok/s | ours/vllm |",
        "|---|---|---|---|---|---|",
        "| fixed | 16 | 32 | 500.0 | 700.0 | 0.71 (0.50, 1.00) |",
    ]
