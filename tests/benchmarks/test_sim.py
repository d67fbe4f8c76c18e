"""The simulated-clock replay's per-step accounting (benchmarks/sim.py)."""

from __future__ import annotations

from benchmarks.sim import KVSample, ReplayResult


def _sample(running: int, waiting: int, memory_bound: bool = False) -> KVSample:
    return KVSample(10, 0, 0, 90, running=running, waiting=waiting, memory_bound=memory_bound)


def test_requests_waiting_on_something_else_than_memory_are_not_memory_bound_steps():
    # A queue held back by the step's token budget, with 90% of the cache free: memory decided nothing.
    run = ReplayResult(samples=[_sample(80, 20), _sample(100, 0), _sample(40, 0), _sample(2, 0)])
    row = run.mean_over_bound_steps()
    assert row["memory_bound_steps"] == 0
    assert row["running"] == (80 + 100 + 40 + 2) / 4  # over every step, as said by the 0 above


def test_averages_cover_only_the_memory_bound_steps():
    run = ReplayResult(samples=[_sample(8, 5, True), _sample(6, 3, True), _sample(9, 2), _sample(1, 0)])
    row = run.mean_over_bound_steps()
    assert row["memory_bound_steps"] == 2
    assert row["running"] == 7.0
