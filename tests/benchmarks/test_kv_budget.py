"""The KV-budget benchmark's step accounting (benchmarks/kv_budget.py)."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.kv_budget import BudgetRun, _classify, shape_blocks


def _engine(*computed: int):
    seqs = [SimpleNamespace(num_computed_tokens=n, token_ids=[0] * (n + 1)) for n in computed]
    group = SimpleNamespace(seqs=seqs)
    return SimpleNamespace(scheduler=SimpleNamespace(running=[group], waiting=[])), seqs


def test_a_step_with_prompt_tokens_is_a_prefill_step_and_counts_them():
    engine, (a, b) = _engine(100, 7)
    before = {id(a): (99, 100), id(b): (0, 8)}  # a decodes one token, b prefills 7 of its 8
    run = BudgetRun("auto", blocks=10, output_tokens=0, seconds=0.0)
    _classify(run, engine, before, (0.5, 0.8), finished=0)
    assert (run.prefill_steps, run.prefill_tokens, run.prefill_seconds, run.prefill_cpu_seconds) == (1, 7, 0.5, 0.8)
    assert run.decode_steps == 0


def test_a_one_token_prompt_chunk_is_prefill():
    engine, (a,) = _engine(64)
    run = BudgetRun("auto", blocks=10, output_tokens=0, seconds=0.0)
    _classify(run, engine, {id(a): (63, 70)}, (0.1, 0.1), finished=0)  # one token of a prompt with 7 to go
    assert (run.prefill_steps, run.prefill_tokens, run.decode_steps) == (1, 1, 0)


def test_a_sequence_preempted_for_recompute_counts_nothing():
    engine, (a, b) = _engine(0, 41)
    run = BudgetRun("auto", blocks=10, output_tokens=0, seconds=0.0)
    _classify(run, engine, {id(a): (300, 301), id(b): (40, 41)}, (0.1, 0.1), finished=0)  # a starts over
    assert (run.decode_steps, run.decode_running_sum, run.prefill_tokens) == (1, 1, 0)


def test_a_decode_step_counts_the_sequences_that_got_a_token_finished_ones_included():
    engine, (a, b) = _engine(100, 50)
    before = {id(a): (99, 100), id(b): (49, 50)}
    run = BudgetRun("int8", blocks=10, output_tokens=0, seconds=0.0)
    _classify(run, engine, before, (0.25, 0.5), finished=2)  # two more ended this step and left the queues
    assert (run.decode_steps, run.decode_running_sum, run.decode_seconds) == (1, 4, 0.25)
    summary = run.summary()
    assert summary["mean_running_decode"] == 4 and summary["ms_per_decoded_token"] == 62.5


def test_the_schedule_only_run_gets_the_blocks_the_shape_would():
    # Qwen2.5-0.5B: 24 layers x 2 KV heads x 64, K and V, 64-token blocks: 786,432 bytes in bf16,
    # 405,504 in int8 (rows of 64 + 2 scale bytes)
    assert shape_blocks("qwen2.5-0.5b", "bfloat16", "auto", 0.02, 64) == 27
    assert shape_blocks("qwen2.5-0.5b", "bfloat16", "int8", 0.02, 64) == 52
    assert shape_blocks("qwen2.5-0.5b", "bfloat16", "fp8", 0.06, 64) == 163
