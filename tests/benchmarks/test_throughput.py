"""The offline benchmark's comparison with vLLM: greedy agreement and the printed table."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import throughput
from benchmarks.throughput import parse_args
from benchmarks.throughput_report import greedy_check, ratios, run_ratios, table
from benchmarks.workloads import Request


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


def test_vllm_dtype_goes_to_vllm_alone(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("sys.argv", ["throughput", "--systems", "ours", "--vllm-dtype", "float32"])
    with pytest.raises(SystemExit):
        parse_args()
    assert "--vllm-dtype=float32 is vLLM's: add vllm to --systems" in capsys.readouterr().err
    jobs = []
    monkeypatch.setattr(throughput, "run_offline", lambda python, job, log: jobs.append(job))
    requests = [Request([5, 6, 7], 4)]
    for vllm_dtype in ("float32", None):
        args = argparse.Namespace(
            dtype="bfloat16", vllm_dtype=vllm_dtype, vllm_python="py", vllm_kv_cache_gib=1.0, vllm_log="log"
        )
        throughput.run_vllm(str(tmp_path), requests, 8, 2, args)
    assert [job.dtype for job in jobs] == ["float32", "bfloat16"]  # the checkpoint's dtype when unset
    assert jobs[0].requests == [([5, 6, 7], 4)] and jobs[0].max_num_seqs == 8


def test_ours_plain_is_the_unquantized_peer_of_a_quantized_shape(monkeypatch, capsys):
    """``ours_plain`` runs beside ``--quantization``'s model (by default too), never without one, and not
    beside an AWQ ``--model``, whose plain twin the benchmark cannot write."""
    monkeypatch.setattr("sys.argv", ["throughput", "--quantization", "awq"])
    assert "ours_plain" in parse_args().systems
    monkeypatch.setattr("sys.argv", ["throughput"])
    assert "ours_plain" not in parse_args().systems
    for argv in (
        ["--systems", "ours,ours_plain"],
        ["--systems", "ours_plain", "--quantization", "awq", "--model", "m"],
    ):
        monkeypatch.setattr("sys.argv", ["throughput", *argv])
        with pytest.raises(SystemExit):
            parse_args()
        assert "ours_plain, the unquantized peer of --quantization's model" in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", ["throughput", "--quantization", "int8", "--systems", "ours,ours_plain"])
    assert parse_args().systems == ["ours", "ours_plain"]


def test_each_repeat_gives_ours_over_the_plain_model_as_over_vllm():
    runs = [{"tokens_per_s": {"ours": 30.0, "ours_plain": 20.0}}, {"tokens_per_s": {"ours": 36.0, "ours_plain": 20.0}}]
    assert run_ratios(runs) == {"ours_over_ours_plain_per_run": [1.5, 1.8]}
    rates = {"ours": 33.0, "ours_plain": 20.0}
    case = dict(workload="fixed", batch_size=1, num_requests=4, tokens_per_s=rates, runs=runs)
    case |= ratios(rates) | run_ratios(runs)
    lines = table({"systems": ["ours", "ours_plain"], "cases": [case]}).splitlines()
    assert lines[0] == "| outputs | batch | requests | ours tok/s | ours_plain tok/s | ours/ours_plain |"
    assert lines[2] == "| fixed | 1 | 4 | 33.0 | 20.0 | 1.65 (1.50, 1.80) |"
