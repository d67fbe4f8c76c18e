"""The paper benchmarks at smoke scale: the properties that hold on any machine.

Each experiment of ``python -m benchmarks.paper`` runs on a tiny random LLaMA with a few
short requests and a KV budget small enough that memory decides who runs.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks import paper_features, paper_kv, paper_memory
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
    result = paper_memory.fig13(quantized)
    for workload in ("sharegpt", "alpaca"):
        rows = result[workload]["allocators"]
        # the load grows with the budget, so memory still decides for the 8-bit cache
        assert rows["paged"]["memory_bound_steps"] > 0, (workload, rows["paged"])
        assert rows["paged-auto"]["memory_bound_steps"] > 0, (workload, rows["paged-auto"])
        assert rows["paged"]["running"] > 1.5 * rows["paged-auto"]["running"], (workload, rows)
    assert (results_dir / "fig13-smoke-kv-int8.json").exists()


def test_equal_memory_follows_the_dtype_the_engine_runs(ctx):
    bf16 = dataclasses.replace(ctx, profile=dataclasses.replace(SMOKE, engine={"dtype": "bfloat16"}))
    int8, int8_bf16 = (dataclasses.replace(c, kv_cache_dtype="int8") for c in (ctx, bf16))
    row = 16 + 2  # the tiny LLaMA's heads of 16 and an int8 row's scale
    assert int8.kv_blocks_per_budget_block() == 4 * 16 / row  # the checkpoint is float32, as the engine runs it
    assert int8_bf16.kv_blocks_per_budget_block() == 2 * 16 / row
    assert dataclasses.replace(bf16, kv_cache_dtype="fp8").kv_blocks_per_budget_block() == 2.0
    assert int8.memory_bound_requests("sharegpt") == 57  # ceil(16 x 3.56)


def test_an_8bit_cache_sustains_a_higher_rate_in_the_same_memory(ctx, results_dir):
    quantized = dataclasses.replace(ctx, kv_cache_dtype="int8", clocks=("roofline",), workloads=("sharegpt",))
    data = paper_kv.fig12kv(quantized)["roofline"]
    assert data.endswith("fig12kv-smoke-roofline-kv-int8")
    result = json.loads((results_dir / "fig12kv-smoke-roofline-kv-int8.json").read_text())["sharegpt"]
    assert result["kv_blocks"]["paged-int8"] > 3 * result["kv_blocks"]["paged-auto"]
    rates = {name: s["rate"] for name, s in result["sustainable_rate"].items()}
    assert rates["paged-int8"] > rates["paged-auto"] > 0, rates


def test_the_roofline_reads_fewer_bytes_from_an_8bit_cache():
    fp16 = paper_kv.roofline_for("roofline", "auto").kv_bytes_per_token
    assert paper_kv.roofline_for("roofline", "fp8").kv_bytes_per_token == fp16 // 2
    assert paper_kv.roofline_for("roofline", "int8").kv_bytes_per_token == fp16 * 130 // 256  # 128 + 2 scale bytes
    assert paper_kv.roofline_for("measured", "int8") is None
