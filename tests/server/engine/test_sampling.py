"""Sampling parameters through the whole engine: seeds, stops, lengths, validation, aborts."""

from __future__ import annotations

import pytest

from pagedllm.server import LLM, SamplingParams
from tests.support import assert_all_blocks_free

PROMPT = {"prompt_token_ids": [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama, block_size=8, num_gpu_blocks_override=256)


def generate(llm, **params):
    return llm.generate([PROMPT], SamplingParams(**params))[0].outputs


def test_seeded_sampling_reproduces(llm):
    a = generate(llm, temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=20, ignore_eos=True)
    b = generate(llm, temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=20, ignore_eos=True)
    c = generate(llm, temperature=1.0, top_p=0.9, top_k=50, seed=8, max_tokens=20, ignore_eos=True)
    assert a[0].token_ids == b[0].token_ids
    assert a[0].token_ids != c[0].token_ids


def test_parallel_samples_are_seeded_and_distinct(llm):
    a = generate(llm, n=3, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    b = generate(llm, n=3, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len({tuple(o.token_ids) for o in a}) > 1
    assert_all_blocks_free(llm)


def test_seeded_generators_go_with_their_requests(llm):
    engine = llm.llm_engine
    sampler = engine.runner.sampler
    generate(llm, n=2, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True)
    assert sampler.num_generators == 1  # one per request, until the next step hears it finished
    engine.add_request("kept", PROMPT, SamplingParams(temperature=1.0, seed=6, max_tokens=50, ignore_eos=True))
    engine.add_request("aborted", PROMPT, SamplingParams(temperature=1.0, seed=7, max_tokens=50, ignore_eos=True))
    engine.step()
    assert sampler.num_generators == 2  # the finished request's went; both new ones drew
    engine.abort_request("aborted")
    engine.step()
    assert sampler.num_generators == 1
    engine.abort_request("kept")


def test_max_tokens_and_length_reason(llm):
    out = generate(llm, temperature=0, max_tokens=9, ignore_eos=True)[0]
    assert len(out.token_ids) == 9 and out.finish_reason == "length"


def test_stop_token_ids_end_generation(llm):
    greedy = generate(llm, temperature=0, max_tokens=12, ignore_eos=True)[0].token_ids
    stop = greedy[4]
    out = generate(llm, temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop])[0]
    assert out.token_ids == greedy[: greedy.index(stop) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_min_tokens_hold_back_stop_tokens(llm):
    greedy = generate(llm, temperature=0, max_tokens=12, ignore_eos=True)[0].token_ids
    out = generate(llm, temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[greedy[0]], min_tokens=3)[0]
    assert len(out.token_ids) >= 3
    assert greedy[0] not in out.token_ids[:3]


def test_stop_string_truncates_text(llm):
    full = generate(llm, temperature=0, max_tokens=24, ignore_eos=True)[0]
    candidates = [ch for ch in full.text[3:] if ch.isprintable() and ch != "\ufffd"]
    if not candidates:
        pytest.fail(f"greedy text {full.text!r} has no printable character to stop on")
    stop = candidates[0]
    out = generate(llm, temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    kept = generate(llm, temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept[0].text == full.text[: full.text.index(stop) + len(stop)]


def test_eos_ends_generation_unless_ignored(tiny_llama):
    llm = LLM(model=tiny_llama, num_gpu_blocks_override=64)
    greedy = generate(llm, temperature=0, max_tokens=8, ignore_eos=True)[0].token_ids
    llm.llm_engine.output_processor.eos_token_ids = (greedy[2],)
    out = generate(llm, temperature=0, max_tokens=8)[0]
    assert out.token_ids == greedy[: greedy.index(greedy[2]) + 1] and out.finish_reason == "stop"
    assert len(generate(llm, temperature=0, max_tokens=8, ignore_eos=True)[0].token_ids) == 8


def test_penalties_change_the_distribution(llm):
    plain = generate(llm, temperature=0, max_tokens=16, ignore_eos=True)[0].token_ids
    penalized = generate(
        llm,
        temperature=0,
        max_tokens=16,
        ignore_eos=True,
        repetition_penalty=1.8,
        frequency_penalty=1.5,
        presence_penalty=1.0,
    )[0].token_ids
    assert penalized != plain
    assert len(set(penalized)) >= len(set(plain))


def test_prompt_logprobs_cover_every_prompt_token(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(PROMPT["prompt_token_ids"])
    for token, entry in zip(PROMPT["prompt_token_ids"][1:], out.prompt_logprobs[1:]):
        assert token in entry and len(entry) <= 3


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -3),
        ("min_p", 2.0),
        ("n", 0),
        ("max_tokens", 0),
        ("presence_penalty", 3.0),
        ("repetition_penalty", 0.0),
        ("logprobs", -1),
    ],
)
def test_invalid_parameters_name_field_and_value(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        SamplingParams(**{field: value})


def test_invalid_requests_are_rejected_before_queueing(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="longer than max_model_len"):
        engine.add_request("long", {"prompt_token_ids": [1] * (engine.max_model_len + 1)}, SamplingParams())
    with pytest.raises(ValueError, match="ids must be integers"):
        engine.add_request("bad", {"prompt_token_ids": [10**6]}, SamplingParams())
    with pytest.raises(ValueError, match="logprobs=50"):
        engine.add_request("lp", PROMPT, SamplingParams(logprobs=50))
    assert not engine.has_unfinished_requests()


def test_prompt_larger_than_cache_is_rejected(tiny_llama):
    llm = LLM(model=tiny_llama, block_size=8, num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match="max_model_len=32"):
        llm.generate([{"prompt_token_ids": [1] * 40}], SamplingParams())


def test_abort_frees_every_block(llm):
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(f"a{i}", PROMPT, SamplingParams(temperature=1.0, n=2, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.stats().num_free_gpu_blocks < engine.stats().num_gpu_blocks
    engine.abort_request([f"a{i}" for i in range(4)])
    assert_all_blocks_free(llm)


def test_bad_engine_arguments_raise_value_error(tiny_llama):
    with pytest.raises(ValueError, match="block_size=12"):
        LLM(model=tiny_llama, block_size=12)
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(model=tiny_llama, blok_size=16)
    with pytest.raises(ValueError, match="max_model_len=5000"):
        LLM(model=tiny_llama, max_model_len=5000)


def test_extreme_repetition_penalty_still_samples(llm):
    out = generate(llm, temperature=1.0, repetition_penalty=1e-38, seed=1, max_tokens=4, ignore_eos=True)[0]
    assert len(out.token_ids) == 4


def test_requests_that_could_never_run_are_rejected(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="stop_token_ids contain"):
        engine.add_request("s", PROMPT, SamplingParams(stop_token_ids=[10**6], min_tokens=2))
    with pytest.raises(ValueError, match="best_of=300 is larger than max_num_seqs"):
        engine.add_request("b", PROMPT, SamplingParams(n=1, best_of=300, temperature=1.0))
    assert not engine.has_unfinished_requests()
