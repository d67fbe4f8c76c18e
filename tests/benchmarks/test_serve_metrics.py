"""Side-by-side serving metrics: medians over repeated runs, and ours over vLLM."""

from __future__ import annotations

from benchmarks.serve_metrics import RequestResult, median_summary, side_by_side, summarize


def summary(rps: float, p99_itl_s: float) -> dict:
    """A one-request summary whose request throughput is ``rps`` and whose P99 ITL is ``p99_itl_s``."""
    done = RequestResult(prompt_len=8, output_len=3, ttft=0.05, latency=0.05 + p99_itl_s, itl=[p99_itl_s], success=True)
    return summarize([done], 1.0 / rps)


def test_side_by_side_gives_each_run_each_servers_median_and_ours_over_vllm():
    runs = [
        {"server": "ours", "repeat": 0, "summary": summary(2.0, 0.300)},
        {"server": "vllm", "repeat": 0, "summary": summary(4.0, 0.100)},
        {"server": "ours", "repeat": 1, "summary": summary(3.0, 0.200)},
        {"server": "vllm", "repeat": 1, "summary": summary(3.0, 0.060)},
    ]
    medians = {s: median_summary([r["summary"] for r in runs if r["server"] == s]) for s in ("ours", "vllm")}
    assert medians["ours"]["request_throughput"] == 2.5 and medians["vllm"]["p99_itl_ms"] == 80.0

    rows = side_by_side(runs, medians).splitlines()
    assert len(rows) == 2 + 4 + 2 + 1  # header, runs, medians, ratio
    assert rows[2].startswith("| ours | 1 | 2.00 |") and rows[6].startswith("| ours | median | 2.50 |")
    assert rows[-1].startswith("| ours / vLLM | median | 0.71 |")  # 2.5 / 3.5 req/s
    assert "| 3.12 |" in rows[-1]  # P99 ITL 250 / 80 ms


def test_one_run_of_one_server_has_no_median_or_ratio_rows():
    runs = [{"server": "ours", "repeat": 0, "summary": summary(2.0, 0.3)}]
    rows = side_by_side(runs, {"ours": median_summary([runs[0]["summary"]])}).splitlines()
    assert len(rows) == 3


def test_median_summary_pools_the_errors_of_every_run():
    failed = summarize([RequestResult(prompt_len=1, error="HTTP 500")], 1.0)
    merged = median_summary([failed, summary(1.0, 0.1)])
    assert merged["errors"] == ["HTTP 500"] and merged["completed"] == 0.5


def test_a_before_server_gets_its_own_ratio_row_above_vllms():
    runs = [
        {"server": "ours", "repeat": 0, "summary": summary(3.0, 0.100)},
        {"server": "before", "repeat": 0, "summary": summary(2.0, 0.400)},
        {"server": "vllm", "repeat": 0, "summary": summary(4.0, 0.050)},
    ]
    medians = {s: median_summary([r["summary"] for r in runs if r["server"] == s]) for s in ("ours", "before", "vllm")}
    rows = side_by_side(runs, medians).splitlines()
    assert rows[-2].startswith("| ours / before | median | 1.50 |") and "| 0.25 |" in rows[-2]
    assert rows[-1].startswith("| ours / vLLM | median | 0.75 |")
