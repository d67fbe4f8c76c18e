"""The engine's start-up choices: the token budget resolved for its device, and what it serves with it;
how it is released."""

from __future__ import annotations

import gc
import logging
import weakref
from dataclasses import replace

import pytest
from engine_factories import HFReference, assert_greedy_matches, make_prompts

from pagedllm.server import LLM, RequestOutputKind, SamplingParams
from pagedllm.server.config import ConfigError, EngineConfig
from pagedllm.server.engine.llm_engine import EngineClosedError, LLMEngine
from pagedllm.server.engine.warm_up import WARM_UP_PROMPT_TOKENS
from tests.support import assert_all_blocks_free


def engine(model_dir: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model=model_dir, device="cpu", **kwargs))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_cpu_default_budget_is_4096_and_logged(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm.engine"):
        e = engine(tiny_llama)
    assert e.config.scheduler.token_budget == e.scheduler.token_budget == 4096
    assert "the scheduler batches up to 4096 tokens per step (the cpu default)" in caplog.text
    assert "prompts take up to 256 tokens of a step while more sequences decode" in caplog.text
    assert "4096 tokens per step" in e.describe()


def test_swap_preemption_takes_single_sequences_out_and_back_without_recomputing(tiny_llama):
    """What ``test_preemption_matches[swap]`` (outputs against transformers) does not see: a single
    sequence is swapped, never recomputed (a recompute resets its computed tokens to 0)."""
    e = engine(tiny_llama, block_size=8, num_gpu_blocks_override=16, preemption_mode="swap")
    for i, prompt in enumerate(make_prompts(6, min_len=20, max_len=60, seed=5)):
        e.add_request(str(i), {"prompt_token_ids": prompt}, greedy(40))
    computed: dict[int, int] = {}
    swapped_out = 0
    while e.has_unfinished_requests():
        e.step()
        swapped_out = max(swapped_out, len(e.scheduler.swapped))
        groups = [*e.scheduler.running, *e.scheduler.swapped, *e.scheduler.waiting]
        for seq in (s for g in groups for s in g.seqs):
            assert seq.num_computed_tokens >= computed.get(seq.seq_id, 0), "a sequence was recomputed"
            computed[seq.seq_id] = seq.num_computed_tokens
    assert e.scheduler.num_preemptions > 0 and swapped_out > 0
    assert_all_blocks_free(e)


def test_a_burst_of_prompts_is_answered_over_two_steps_and_matches_transformers(tiny_llama):
    e = engine(tiny_llama, block_size=16)
    prompts = make_prompts(4, min_len=150, max_len=200, seed=7)  # over the CPU's 512-token split
    for i, prompt in enumerate(prompts):
        e.add_request(str(i), {"prompt_token_ids": prompt}, greedy(6))
    outputs, tokens = {}, []
    while e.has_unfinished_requests():
        for o in e.step():
            outputs[o.request_id] = o
        tokens.append([len(outputs[str(i)].outputs[0].token_ids) if str(i) in outputs else 0 for i in range(4)])
    assert tokens[:3] == [[1, 1, 0, 0], [1, 1, 1, 1], [2, 2, 2, 2]]  # then the burst decodes together
    ref = HFReference(tiny_llama)
    for i, prompt in enumerate(prompts):
        assert_greedy_matches(ref, prompt, outputs[str(i)].outputs[0].token_ids, ref.greedy(prompt, 6))
    assert_all_blocks_free(e)


def test_explicit_budget_is_kept(tiny_llama):
    e = engine(tiny_llama, max_num_batched_tokens=96)
    assert e.config.scheduler.token_budget == e.scheduler.token_budget == 96


def test_long_prompt_is_chunked_while_others_decode_and_matches_transformers(tiny_llama):
    e = engine(tiny_llama, block_size=16, max_num_batched_tokens=512)
    short, long = make_prompts(2, min_len=5, max_len=900, seed=3)
    e.add_request("short", {"prompt_token_ids": short}, greedy(30))
    e.step()  # the short prompt is prefilled and decodes from now on
    e.add_request("long", {"prompt_token_ids": long}, greedy(8))
    long_seq = e.scheduler.waiting[-1].seqs[0]
    steps, short_tokens = 0, []
    while long_seq.num_computed_tokens < len(long):
        steps += 1
        out = {o.request_id: o for o in e.step()}
        short_tokens.append(len(out["short"].outputs[0].token_ids))
    assert steps == 2  # 900 tokens in chunks of 511 and 389
    assert short_tokens == [2, 3]  # and the short request got a token in each of those steps
    outputs = {}
    while e.has_unfinished_requests():
        outputs.update({o.request_id: o for o in e.step() if o.finished})
    ref = HFReference(tiny_llama)
    for name, prompt, n in (("short", short, 30), ("long", long, 8)):
        assert_greedy_matches(ref, prompt, outputs[name].outputs[0].token_ids, ref.greedy(prompt, n))


def test_chunked_prefill_off_defaults_to_fit_the_longest_prompt(tiny_llama):
    llm = LLM(model=tiny_llama, device="cpu", enable_chunked_prefill=False)
    e = llm.llm_engine
    assert e.config.scheduler.token_budget >= e.max_model_len == 1024
    prompt = make_prompts(1, min_len=e.max_model_len - 1, max_len=e.max_model_len - 1)[0]
    [out] = llm.generate([{"prompt_token_ids": prompt}], greedy(4))
    assert len(out.outputs[0].token_ids) == 1  # the prompt fills the model but for the one token
    assert out.outputs[0].finish_reason == "length"


def test_chunked_prefill_off_refuses_an_explicit_budget_too_small(tiny_llama):
    with pytest.raises(ConfigError) as info:
        engine(tiny_llama, enable_chunked_prefill=False, max_num_batched_tokens=300)
    assert (info.value.field, info.value.value) == ("max_num_batched_tokens", 300)
    assert "max_model_len=1024" in str(info.value)


def test_warm_up_runs_a_prefill_and_a_decode_step_and_leaves_nothing_behind(tiny_llama):
    """So the kernels are compiled (Numba here, Triton on a GPU) before the first request,
    the CPU's prefill-size builds too (a prompt of a typical length)."""
    e = engine(tiny_llama)
    decodes, tokens = [], []
    execute = e.runner.run

    def counting(step):
        decodes.append(step.meta.num_decode_tokens)
        tokens.append(step.input_ids.size)
        return execute(step)

    e.runner.run = counting
    e.warm_up()
    assert decodes == [0, 1]
    assert tokens == [WARM_UP_PROMPT_TOKENS, 1]
    assert not e.has_unfinished_requests()
    stats = e.stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks


def test_warm_up_leaves_no_cached_prefix_no_kv_event_and_no_prefix_cache_counts(tiny_llama):
    """A KV event subscriber (a router) must see the first user block as the first event, and
    a cache hit rate must count user prompts only."""
    e = engine(tiny_llama)
    published: list = []

    class Recorder:
        num_dropped = 0

        def publish(self, events):
            published.append(events)

    e.kv_event_publisher = Recorder()
    e.block_manager.kv_events = e.block_manager.gpu.events = ["earlier"]  # recorded before the warm-up
    e.warm_up()
    assert published == [["earlier"]] and e.block_manager.take_kv_events() == []
    assert e.kv_event_publisher is not None
    stats = e.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    # a prompt of the warm-up's tokens finds nothing cached
    eos = e.model_info.eos_token_ids[0]
    e.add_request("a", {"prompt_token_ids": [eos] * 64}, greedy(1))
    while e.has_unfinished_requests():
        e.step()
    assert e.stats().prefix_cache_hits == 0
    assert len(published) > 1, "the user's blocks are published"


def test_leaving_the_with_block_frees_the_cache_and_refuses_more_work(tiny_llama):
    with engine(tiny_llama, num_gpu_blocks_override=16) as e:
        e.add_request("a", {"prompt_token_ids": [1, 2, 3]}, greedy(2))
        while e.has_unfinished_requests():
            e.step()
        cache = weakref.ref(e.runner.kv_caches[0][0])
        assert not e.is_closed
    assert e.is_closed and e.runner.kv_caches == [] and e.runner.host_caches == []
    assert cache() is None, "the KV cache tensors are still referenced after shutdown"
    with pytest.raises(EngineClosedError, match="the engine was shut down"):
        e.add_request("b", {"prompt_token_ids": [1, 2, 3]}, greedy(2))
    with pytest.raises(EngineClosedError, match="the engine was shut down"):
        e.step()
    e.shutdown()  # idempotent


def test_a_dropped_engine_is_freed_by_reference_counting_alone(tiny_llama):
    """Nothing the engine owns points back at it, so dropping it releases it without a gc pass."""
    e = engine(tiny_llama, num_gpu_blocks_override=16)
    e.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(n=2, best_of=2, max_tokens=2, seed=1))
    while e.has_unfinished_requests():
        e.step()
    dropped, runner = weakref.ref(e), e.runner
    gc.collect()
    gc.disable()
    try:
        del e
        assert dropped() is None, "the engine sits in a reference cycle"
        assert runner.kv_caches == [], "dropping the engine did not shut it down"
    finally:
        gc.enable()


def test_a_final_only_request_gets_one_output_when_it_ends_equal_to_the_cumulative_one(tiny_llama):
    """Outputs per step for a cumulative request, one at its end for a FINAL_ONLY one, in one batch;
    the last outputs agree, and a failure is still reported at once."""
    final_only = replace(greedy(5), output_kind=RequestOutputKind.FINAL_ONLY)
    with engine(tiny_llama, num_gpu_blocks_override=32) as e:
        e.add_request("each", {"prompt_token_ids": [5, 6, 7]}, greedy(5))
        e.add_request("last", {"prompt_token_ids": [5, 6, 7]}, final_only)
        seen: dict[str, list] = {"each": [], "last": []}
        while e.has_unfinished_requests():
            for output in e.step():
                seen[output.request_id].append(output)
    assert len(seen["each"]) == 5 and [o.finished for o in seen["last"]] == [True]
    (each, last) = seen["each"][-1].outputs[0], seen["last"][0].outputs[0]
    assert (last.token_ids, last.finish_reason) == (each.token_ids, each.finish_reason) == (last.token_ids, "length")
    assert len(last.token_ids) == 5


def test_llm_generate_asks_for_final_outputs_only_and_leaves_the_callers_params_alone(tiny_llama):
    params = greedy(4)
    llm = LLM(model=tiny_llama, device="cpu", num_gpu_blocks_override=32)
    try:
        engine_params = []
        add = llm.llm_engine.add_request
        llm.llm_engine.add_request = lambda rid, prompt, p, **kw: (engine_params.append(p), add(rid, prompt, p, **kw))
        (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)
    finally:
        llm.llm_engine.shutdown()
    assert len(out.outputs[0].token_ids) == 4 and out.finished
    assert [p.output_kind for p in engine_params] == [RequestOutputKind.FINAL_ONLY]
    assert params.output_kind is RequestOutputKind.CUMULATIVE


def test_delta_outputs_are_refused_by_name_and_a_kind_given_as_its_number_is_taken():
    with pytest.raises(ConfigError) as info:
        SamplingParams(output_kind=RequestOutputKind.DELTA)
    assert info.value.field == "output_kind" and "CUMULATIVE or FINAL_ONLY" in str(info.value)
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY  # type: ignore[arg-type]
