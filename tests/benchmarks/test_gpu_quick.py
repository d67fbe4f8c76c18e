"""The GPU summary's pieces that run without a GPU: the shape's floor, the offline run's
deadline and the summary of whatever sections wrote."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_quick
from benchmarks.gpu_step_profile import decode_steps, kv_bytes, weight_bytes
from benchmarks.model_shapes import SHAPES, shape_config, write_random_model
from tests.support import assert_all_blocks_free


def test_the_llama_3_8b_floor_counts_every_bf16_weight_and_its_gqa_cache():
    cls, config = shape_config("llama-3-8b")
    with torch.device("meta"):
        model = cls(config)
    params = sum(p.numel() for p in model.parameters())
    assert params / 1e9 == pytest.approx(8.03, abs=0.01)  # the published 8.03B
    assert weight_bytes("llama-3-8b") == 2 * params
    assert kv_bytes(1, 1, "llama-3-8b") == 2 * 2 * 32 * 8 * 128  # K and V, 32 layers, 8 KV heads of 128


@pytest.fixture
def tiny_llm(tmp_path, monkeypatch):
    llm = _tiny_llm(tmp_path, monkeypatch)
    yield llm
    llm.shutdown()


def _tiny_llm(tmp_path, monkeypatch, **engine_args):
    from pagedllm.server import LLM

    tiny = dict(SHAPES["bench"], hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    monkeypatch.setitem(SHAPES, "tiny", tiny | dict(num_key_value_heads=4, vocab_size=512))
    write_random_model(str(tmp_path), "tiny", "float32")
    return LLM(model=str(tmp_path), skip_tokenizer_init=True, block_size=16, num_gpu_blocks_override=64, max_num_seqs=8,
               **engine_args)  # fmt: skip


def _clock_of_steps(engine):
    """A clock that reads the number of engine steps so far (one second each), from 0."""
    start = engine._num_steps
    return lambda: float(engine._num_steps - start)


def test_the_offline_run_counts_every_token_and_stops_at_its_deadline_freeing_the_rest(tiny_llm, monkeypatch):
    done = gpu_quick._offline(tiny_llm, 6, deadline_s=600, vocab=512)
    assert done["finished"] == 6 and not done["stopped_at_deadline"]
    from benchmarks.workloads import sample_requests

    assert done["output_tokens"] == sum(r.output_len for r in sample_requests("sharegpt", 6, 502, seed=0))
    cut = gpu_quick._offline(tiny_llm, 6, deadline_s=0.0, vocab=512)
    assert cut["stopped_at_deadline"] and cut["finished"] < 6
    # a deadline inside the run: the requests still running count the tokens they made
    monkeypatch.setattr(gpu_quick.time, "perf_counter", _clock_of_steps(tiny_llm.llm_engine))
    part = gpu_quick._offline(tiny_llm, 6, deadline_s=5.5, vocab=512)
    assert part["stopped_at_deadline"] and part["finished"] < 6
    assert part["output_tokens"] >= 6 * 4, "5 steps: a prefill, then 4 tokens or more for each request"
    assert not tiny_llm.llm_engine.has_unfinished_requests()
    assert_all_blocks_free(tiny_llm)


def test_the_summary_takes_what_the_sections_wrote_and_names_the_missing_ones(tmp_path):
    sections = {
        "env": {"device": "NVIDIA H200", "copy_gbs": 4300.0},
        "engine": {
            "startup_s": 41.0,
            "launches_per_layer": 11.2,
            "steps": [{"batch": 1, "step_ms": 5.0, "floor_ms": 3.7, "floor_over_step": 0.74, "gpu_busy": 0.9}],
            "offline": {"offline_out_tok_s": 5000.0},
        },
        "serve": {"runs": {"4": {"prompts": 40, "error": "not done in 45 s"}}},
        "kernels": {
            "decode_vs_sdpa": [
                {"batch": 1, "context_len": 512, "ratio_vs_sdpa": 1.2, "timer": "cudagraph"},
                {"batch": 1, "context_len": 512, "ratio_vs_sdpa": 7.0, "timer": "do_bench"},
            ]
        },
    }
    for name, data in sections.items():
        (tmp_path / f"quick-{name}.json").write_text(json.dumps(data))
    summary = gpu_quick.summarize(tmp_path)
    assert summary["device"] == "NVIDIA H200" and summary["copy_gbs"] == 4300.0
    assert summary["step_ms"] == {"1": 5.0} and summary["floor_ms"] == {"1": 3.7} and summary["gpu_busy"] == {"1": 0.9}
    assert summary["offline_out_tok_s"] == 5000.0 and summary["launches_per_layer"] == 11.2
    assert summary["decode_vs_sdpa"] == {"b1_ctx512": 1.2, "b1_ctx512_do_bench": 7.0}
    assert summary["sections_missing"] == ["tests"] and summary["kernel_tests_passed"] is None
    text = gpu_quick.markdown(summary)
    assert "| 1 | 5.0 | 3.7 | 0.74 | 0.9 |" in text and "not done in 45 s" in text
    gpu_quick.main(["summary", "--out", str(tmp_path)])
    assert json.loads((tmp_path / f"summary-{summary['date']}-nvidia-h200.json").read_text())["shape"] == "llama-3-8b"


def test_decode_steps_time_decodes_only_and_free_their_blocks(tiny_llm):
    stats = decode_steps(tiny_llm, batch=3, prompt_len=40, steps=4, profiled=2)
    assert stats["step_ms"] > 0 and 0 <= stats["gpu_busy"]  # no GPU here: no kernel time
    assert not tiny_llm.llm_engine.has_unfinished_requests()
    assert_all_blocks_free(tiny_llm)


def test_decode_steps_time_an_engine_that_schedules_ahead(tmp_path, monkeypatch):
    # NOTE: what scripts/gpu-validate.sh's async stage runs: a step with a step in flight behind it
    llm = _tiny_llm(tmp_path, monkeypatch, async_scheduling=True)
    try:
        stats = decode_steps(llm, batch=3, prompt_len=40, steps=4, profiled=2)
        assert stats["step_ms"] > 0
        assert not llm.llm_engine.has_unfinished_requests()
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
