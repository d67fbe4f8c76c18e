"""The step profile's clocks add up: every part of a decode step is counted once."""

from __future__ import annotations

import pytest

from benchmarks.step_clock import Clock, components
from benchmarks.step_profile import clocked, make_engine
from benchmarks.vllm_profile import parse_profiler_table
from benchmarks.workloads import Request


def test_components_partition_the_step():
    step = {
        "engine.step": 10.0,
        "schedule": 0.5,
        "step inputs": 1.0,
        "runner.execute": 6.0,
        "attention metadata": 0.2,
        "model.forward": 5.0,
        "embedding": 0.1,
        "linear (q, k, v, o, gate, up, down)": 2.0,
        "RMSNorm": 0.4,
        "rotary": 0.3,
        "attention.forward": 1.5,
        "KV write": 0.2,
        "decode attention kernel": 1.0,
        "LM head (logits)": 0.4,
        "step_results.apply": 1.2,
        "sampler": 0.8,
        "outputs (RequestOutput per request)": 0.6,
    }
    parts = components(step)
    assert sum(parts.values()) == pytest.approx(10.0)
    assert parts["input preparation (step inputs, block tables)"] == pytest.approx(1.0)
    assert parts["layer glue (SiLU * up, residual adds, Python)"] == pytest.approx(0.7)
    assert parts["attention glue (views, output copy)"] == pytest.approx(0.3)
    assert parts["engine glue (step rest)"] == pytest.approx(0.7)


def test_an_instrumented_engine_times_every_part_of_its_decode_steps(tmp_path):
    from pagedllm.server.demo import save_tiny_llama

    model = save_tiny_llama(str(tmp_path / "model"), max_position_embeddings=2048)
    llm = make_engine(model, batch=2, threads=1, dtype="float32")
    requests = [Request([5, 6, 7, 8], 6), Request([9, 10], 6), Request([11, 12, 13], 4)]

    mean, total, count, share = clocked(llm.llm_engine, requests, batch=2)

    assert count == 5  # the first two requests decode together 5 times; the third comes after, alone
    assert sum(mean.values()) == pytest.approx(total)
    for part in ("schedule (scheduler + block manager)", "linear layers (q, k, v, o, gate, up, down)", "sampler"):
        assert mean[part] > 0, part
    assert mean["decode attention kernel"] > 0 and mean["KV write"] > 0
    assert share["steps_with_prefill"] == 2 and share["steps"] == 5 + 2 + 3
    llm.shutdown()


def test_quantized_projections_count_as_linear_layers_not_glue(tmp_path):
    from benchmarks.quant_checkpoint import write_awq_model

    path = str(tmp_path / "awq")
    write_awq_model(path, "bench", group=32)
    llm = make_engine(path, batch=2, threads=1, dtype="float32")
    mean, _, count, _ = clocked(llm.llm_engine, [Request([5, 6, 7, 8], 5), Request([9, 10], 5)], batch=2)

    assert count == 4
    linear = mean["linear layers (q, k, v, o, gate, up, down)"]
    assert linear > mean["layer glue (SiLU * up, residual adds, Python)"] > 0
    llm.shutdown()


def test_clock_wrappers_count_time_even_when_the_call_raises():
    clock = Clock()

    def fails():
        raise ValueError("no")

    with pytest.raises(ValueError):
        clock.timed("x", fails)()
    clock.end_step()
    assert clock.steps[0][2]["x"] > 0


VLLM_TABLE = """\
-------------------------------------  ----------  ---------  -----------  ---------  ------------  ----------
                                 Name  Self CPU %   Self CPU  CPU total %  CPU total  CPU time avg  # of Calls
-------------------------------------  ----------  ---------  -----------  ---------  ------------  ----------
                        _C::onednn_mm      46.45%  223.880ms       46.63%  224.746ms     340.524us         660
execute_context_0(0)_generation_16(16)      5.58%   26.876ms       99.64%  480.235ms      24.012ms          20
      ## Call CompiledFxGraph None ##      4.15%   20.012ms       85.97%     1.895s      20.717ms          20
                     aten::as_strided      0.19%  934.760us        0.19%  934.760us       0.477us        1960
-------------------------------------  ----------  ---------  -----------  ---------  ------------  ----------
Self CPU time total: 480.862ms
"""


def test_vllms_profiler_table_reads_into_milliseconds_and_calls():
    assert parse_profiler_table(VLLM_TABLE) == [
        ("_C::onednn_mm", 223.88, 224.746, 660),
        ("execute_context_0(0)_generation_16(16)", 26.876, 480.235, 20),
        ("## Call CompiledFxGraph None ##", 20.012, 1895.0, 20),
        ("aten::as_strided", pytest.approx(0.93476), pytest.approx(0.93476), 1960),
    ]
