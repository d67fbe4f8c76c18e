"""The offline benchmark's comparison with vLLM: greedy agreement and the printed table."""

from __future__ import annotations

import pytest

from benchmarks.throughput import greedy_check, parse_args, ratios, run_ratios, table


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


def test_table_shows_medians_ours_over_vllm_with_each_runs_ratio_and_cpu_per_token():
    runs = [
        {"tokens_per_s": {"ours": 400.0, "vllm": 800.0}, "cpu_ms_per_token": {"ours": 4.0, "vllm": 3.0}},
        {"tokens_per_s": {"ours": 600.0, "vllm": 600.0}, "cpu_ms_per_token": {"ours": 3.0, "vllm": 3.5}},
    ]
    rates = {"ours": 500.0, "vllm": 700.0}
    case = dict(workload="fixed", batch_size=16, num_requests=32, tokens_per_s=rates, runs=runs)
    case |= {"cpu_ms_per_token": {"ours": 3.5, "vllm": 3.25}} | ratios(rates) | run_ratios(runs)
    text = table({"systems": ["ours", "vllm"], "cases": [case]})
    assert text.splitlines() == [
        "| outputs | batch | requests | ours tok/s | vllm tok/s | ours/vllm | ours CPU ms/tok | vllm CPU ms/tok |",
        "|---|---|---|---|---|---|---|---|",
        "| fixed | 16 | 32 | 500.0 | 700.0 | 0.71 (0.50, 1.00) | 3.50 | 3.25 |",
    ]


def test_run_ratios_need_both_engines_in_the_runs():
    assert run_ratios([{"tokens_per_s": {"ours": 1.0, "ceiling": 2.0}}]) == {}


def test_online_int8_runs_ours_alone(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["throughput", "--quantization", "int8", "--systems", "ours,hf_static"])
    with pytest.raises(SystemExit):
        parse_args()
    assert "only ours does: run it with --systems ours" in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", ["throughput", "--quantization", "int8", "--systems", "ours"])
    assert parse_args().quantization == "int8"
