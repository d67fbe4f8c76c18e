"""The host-overhead benchmark runs end to end at a tiny scale and reports what it promises."""

from __future__ import annotations

from benchmarks import host_overhead


def test_it_reports_the_threads_the_step_time_per_batch_and_mode_and_a_profile(tmp_path, capsys):
    host_overhead.main(
        ["--model", str(tmp_path), "--vocab", "600", "--batches", "2", "3", "--steps", "3", "--top", "3"]
    )
    out = capsys.readouterr().out
    assert out.startswith("torch threads: 1")
    for mode in ("ids", "text"):
        for batch in (2, 3):
            assert f"[{mode}] batch {batch}: " in out and "us per decode step (median of 3)" in out
    assert "Ordered by: internal time" in out


def test_final_only_requests_are_timed_beside_cumulative_ones(tmp_path, capsys):
    host_overhead.main(
        ["--model", str(tmp_path), "--vocab", "600", "--batches", "2", "--steps", "3", "--top", "0", "--modes", "ids"]
        + ["--output-kinds", "cumulative", "final_only"]
    )
    out = capsys.readouterr().out
    assert "[ids] batch 2: " in out and "[ids, final only] batch 2: " in out
