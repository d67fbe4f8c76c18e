"""The paper benchmarks at smoke scale: the properties that hold on any machine.

Each experiment of ``python -m benchmarks.paper`` runs on a tiny random LLaMA with a few
short requests and a KV budget small enough that memory decides who runs.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks import paper_features, paper_memory
from benchmarks.paper_setting import CPU, Context, build_model

SMOKE = dataclasses.replace(
    CPU,
    name="smoke",
    budget_blocks={"sharegpt": 40, "alpaca": 24, "chatbot": 40, "prefix": 40},
    num_requests={"sharegpt": 16, "alpaca": 24, "chatbot": 8, "prefix": 10},
    rates={
        "measured": {"sharegpt": [50, 400], "alpaca": [100, 800], "chatbot": [400]},
        "roofline": {"sharegpt": [5, 50], "alpaca": [10, 100], "chatbot": [50]},
    },
    block_sizes=(4, 16),
    max_model_len=512,
    max_input=64,
    max_output=48,
    block_size_rates={"sharegpt": 200},
    preemption_budget_tokens=256,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[str, int]:
    """The tiny model's directory and vocabulary size, written once for the module."""
    path = str(tmp_path_factory.mktemp("paper") / "model")
    return path, build_model(SMOKE, path)


@pytest.fixture
def results_dir(tmp_path):
    return tmp_path


@pytest.fixture
def ctx(model, results_dir) -> Context:
    model_dir, vocab = model
    return Context(
        SMOKE, model_dir, seed=0, threads=1, vocab=vocab, clocks=("measured", "roofline"), results=str(results_dir)
    )


def test_paging_wastes_least_and_reservations_order_oracle_pow2_max(ctx, results_dir):
    result = paper_memory.fig13(ctx)
    for workload in ("sharegpt", "alpaca"):
        rows = result[workload]["allocators"]
        waste = {a: rows[a]["waste_pct"] for a in rows}
        assert waste["paged"] < min(waste["oracle"], waste["pow2"], waste["max"]), waste
        assert waste["oracle"] <= waste["pow2"] <= waste["max"], waste
        assert rows["paged"]["running"] > rows["max"]["running"]
        assert result[workload]["identical_greedy_tokens"]
    assert (results_dir / "fig13-smoke.png").stat().st_size > 0


def test_latency_sweeps_report_a_rate_per_system(ctx, results_dir):
    results = paper_memory.fig12(ctx)
    assert set(results) == {"measured", "roofline"}
    data = json.loads((results_dir / "fig12-smoke-measured.json").read_text())
    assert set(data["sharegpt"]["sustainable_rate"]) == {"paged", "oracle", "pow2", "max", "hf-static", "hf-continuous"}
    assert (results_dir / "fig12-smoke-roofline.png").exists()


def test_sharing_disabled_uses_more_blocks(ctx):
    for row in paper_features.fig14(ctx)["rows"]:
        assert row["unshared"]["blocks_per_running_seq"] > row["shared"]["blocks_per_running_seq"], row


def test_prefix_caching_serves_hits(ctx):
    result = paper_features.fig16(ctx)
    for prefix in ("prefix_80", "prefix_341"):
        assert result[prefix]["on"]["prefix_cache_hit_pct"] > 50
        assert result[prefix]["off"]["prefix_cache_hit_pct"] == 0


def test_chatbot_block_size_and_preemption_experiments_run(ctx, results_dir):
    paper_memory.fig17(ctx)
    assert set(paper_features.fig18(ctx)["sharegpt"]["normalized_latency"]) == {4, 16}
    result = paper_features.fig19(ctx)
    assert all(result[mode][bs]["preemptions"] > 0 for mode in ("swap", "recompute") for bs in (4, 16))
    assert len(list(results_dir.glob("*.png"))) == 4


def test_an_8bit_cache_runs_more_sequences_in_the_same_memory(ctx, results_dir):
    quantized = dataclasses.replace(ctx, kv_cache_dtype="int8")
    assert quantized.kv_blocks_per_budget_block() > 1.8  # float32 rows of 4 bytes against 1 (+ 2 scale bytes)
    rows, rows_q = (paper_memory.fig13(c)["sharegpt"]["allocators"]["paged"] for c in (ctx, quantized))
    assert rows_q["running"] > rows["running"]
    assert (results_dir / "fig13-smoke-kv-int8.json").exists()
