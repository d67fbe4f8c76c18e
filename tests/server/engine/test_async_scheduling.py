"""Asynchronous scheduling gives the tokens of steps run in turn, and leaves no block behind.

Each test runs the same requests through an engine with ``async_scheduling`` off and one with
it on (the tiny random LLaMA on the CPU, where the step runs on the executor's thread) and
compares every request's tokens, text and finish reason; then every block must be free.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from engine_factories import HFReference, assert_greedy_matches, make_prompts
from fault_doubles import FAULTS_ENV, WORKER
from lora_factories import save_random_adapter

from pagedllm.server import LLM, LoRARequest, SamplingParams
from pagedllm.server.args import engine_config_from_args
from pagedllm.server.config import ConfigError, EngineConfig
from pagedllm.server.engine.async_engine import AsyncLLMEngine
from pagedllm.server.engine.llm_engine import LLMEngine
from pagedllm.server.entrypoints.cli import build_parser
from pagedllm.server.sampling_params import GuidedDecodingParams
from tests.support import assert_all_blocks_free

PROMPTS = make_prompts(10, min_len=3, max_len=40, seed=11)


def engine(model: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model=model, device="cpu", block_size=8, **kwargs))


def run(e: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple]:
    """Run ``requests`` (id -> prompt, params) to the end; id -> (token ids per sequence, texts, finish reasons)."""
    for request_id, (prompt, params) in requests.items():
        e.add_request(request_id, {"prompt_token_ids": prompt}, params)
    done = {}
    while e.has_unfinished_requests():
        for output in e.step():
            assert output.request_id not in done, "no output after a request finished"
            if output.finished:
                done[output.request_id] = _summary(output)
    assert_all_blocks_free(e)
    return done


def _summary(output) -> tuple:
    return tuple((tuple(c.token_ids), c.text, c.finish_reason) for c in output.outputs)


def both(model: str, requests: dict, **kwargs) -> tuple[dict, dict, LLMEngine]:
    """The outputs with async scheduling off and on, and the engine that ran with it on."""
    off = run(engine(model, **kwargs), requests)
    e = engine(model, async_scheduling=True, **kwargs)
    on = run(e, requests)
    assert set(on) == set(off) == set(requests)
    return off, on, e


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_greedy_tokens_are_those_of_steps_in_turn(tiny_llama):
    requests = {f"r{i}": (p, greedy(3 + 5 * i)) for i, p in enumerate(PROMPTS)}
    off, on, e = both(tiny_llama, requests, max_num_seqs=4)
    assert on == off
    assert e.pipeline is not None and e.pipeline.num_ahead > 10  # most steps were scheduled ahead
    for i in range(len(PROMPTS)):
        assert len(on[f"r{i}"][0][0]) == 3 + 5 * i


def test_steps_launched_in_the_callers_thread_give_the_same_tokens(tiny_llama):
    """The GPU's way (:meth:`Executor.submit` queues each step in the engine's thread, no step thread),
    taken here on the CPU: greedy and seeded random tokens of steps run in turn, every block free."""
    requests = {f"r{i}": (p, greedy(3 + 5 * i)) for i, p in enumerate(PROMPTS[:6])}
    seeded = {f"s{i}": SamplingParams(temperature=0.8, seed=i, max_tokens=9, ignore_eos=True) for i in range(10)}
    requests.update({request_id: (PROMPTS[i], params) for i, (request_id, params) in enumerate(seeded.items())})
    off = run(engine(tiny_llama, max_num_seqs=4), requests)
    e = engine(tiny_llama, async_scheduling=True, max_num_seqs=4)
    e.executor.queues_on_device = True
    assert run(e, requests) == off
    assert e.pipeline is not None and e.pipeline.num_ahead > 10 and e.executor._stepper is None


def test_seeded_random_tokens_are_those_of_steps_in_turn(tiny_llama):
    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, max_tokens=12, ignore_eos=True)

    requests = {f"r{i}": (p, params(i)) for i, p in enumerate(PROMPTS)}
    off, on, e = both(tiny_llama, requests, max_num_seqs=4)
    assert on == off and e.pipeline.num_ahead > 0


def test_stop_tokens_and_stop_strings_end_the_request_with_nothing_after(tiny_llama):
    plain = run(engine(tiny_llama), {"probe": (PROMPTS[0], greedy(20))})
    tokens = plain["probe"][0][0]
    text = plain["probe"][0][1]
    requests = {
        "stop-token": (PROMPTS[0], greedy(20, stop_token_ids=[tokens[6]])),
        "stop-string": (PROMPTS[0], greedy(20, stop=[text[5:8]])),
        "eos": (PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=30)),
        "other": (PROMPTS[2], greedy(25)),
    }
    off, on, _ = both(tiny_llama, requests)
    assert on == off
    assert on["stop-token"][0][2] == on["stop-string"][0][2] == "stop"
    assert len(on["stop-token"][0][0]) <= 7 and len(on["other"][0][0]) == 25


def test_abort_mid_generation_leaves_no_output_and_no_block(tiny_llama):
    outputs = {}
    for async_scheduling in (False, True):
        e = engine(tiny_llama, async_scheduling=async_scheduling)
        for i, prompt in enumerate(PROMPTS[:4]):
            e.add_request(f"r{i}", {"prompt_token_ids": prompt}, greedy(30))
        seen = {}
        for _ in range(6):
            for output in e.step():
                seen[output.request_id] = output
        e.abort_request(["r1", "r2"])
        done = {}
        while e.has_unfinished_requests():
            for output in e.step():
                assert output.request_id not in ("r1", "r2"), "an aborted request got an output"
                if output.finished:
                    done[output.request_id] = _summary(output)
        assert set(done) == {"r0", "r3"}
        assert_all_blocks_free(e)
        outputs[async_scheduling] = done
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_tiny_cache(tiny_llama, mode):
    requests = {f"r{i}": (p, greedy(24)) for i, p in enumerate(PROMPTS[:6])}
    off, on, e = both(tiny_llama, requests, num_gpu_blocks_override=14, preemption_mode=mode, swap_space=1)
    assert on == off
    assert e.scheduler.num_preemptions > 0  # preemptions happen in the steps scheduled in turn
    assert e.pipeline.num_ahead > 0


def test_prefix_caching_hits_and_tokens(tiny_llama):
    shared = make_prompts(1, min_len=33, max_len=33, seed=5)[0]
    requests = {f"r{i}": (shared + p[:5], greedy(10)) for i, p in enumerate(PROMPTS[:6])}
    off, on, e = both(tiny_llama, requests, enable_prefix_caching=True, max_num_seqs=2)
    assert on == off
    assert e.block_manager.prefix_cache_hits > 0


def test_parallel_samples_beams_and_grammars_run_in_turn(tiny_llama):
    choice = GuidedDecodingParams(regex="(yes|no|maybe) [a-z]{3,8}")
    requests = {
        "grammar": (PROMPTS[3], SamplingParams(temperature=0.7, seed=5, max_tokens=12, guided_decoding=choice)),
        "n2": (PROMPTS[0], SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=9, ignore_eos=True)),
        "best": (PROMPTS[1], SamplingParams(n=1, best_of=3, temperature=0.8, seed=4, max_tokens=7, ignore_eos=True)),
        "beam": (PROMPTS[2], SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=6, ignore_eos=True)),
    }
    off, on, e = both(tiny_llama, requests)
    assert on == off
    assert e.pipeline.num_ahead == 0  # none of these can be followed ahead
    assert on["grammar"][0][1].split()[0] in ("yes", "no", "maybe")


def test_mixed_requests_fall_back_only_where_needed(tiny_llama):
    requests = {
        "plain": (PROMPTS[0], greedy(16)),
        "penalty": (PROMPTS[1], greedy(16, repetition_penalty=1.3, presence_penalty=0.5)),
        "min-tokens": (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=8)),
        "logprobs": (PROMPTS[3], greedy(10, logprobs=2, prompt_logprobs=1)),
        "bias": (PROMPTS[4], greedy(10, logit_bias={5: 3.0})),
    }
    off, on, _ = both(tiny_llama, requests, max_num_seqs=8)
    assert on == off
    only_plain = {"plain": requests["plain"], "bias": requests["bias"]}
    off, on, e = both(tiny_llama, only_plain)
    assert on == off and e.pipeline.num_ahead > 0


def _random_mix(seed: int) -> list[tuple[str, list[int], SamplingParams, int]]:
    """(id, prompt, params, the step() call it arrives before): a seeded mix of what requests do."""
    rng = random.Random(seed)
    shared = make_prompts(1, min_len=20, max_len=20, seed=seed)[0]
    mix = []
    for i, prompt in enumerate(make_prompts(14, min_len=2, max_len=70, seed=seed + 1)):
        prompt = shared + prompt[:10] if rng.random() < 0.4 else prompt
        n = rng.randint(1, 30)
        params = rng.choice(
            [
                SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                SamplingParams(temperature=1.0, top_k=20, seed=i, max_tokens=n, ignore_eos=True),
                SamplingParams(temperature=0.7, seed=i, max_tokens=n, stop_token_ids=list(range(0, 256, 9))),
                SamplingParams(n=2, temperature=0.8, seed=i, max_tokens=n, ignore_eos=True),
                SamplingParams(temperature=0.0, max_tokens=n, repetition_penalty=1.2, ignore_eos=True),
                SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n // 2),
                SamplingParams(temperature=0.0, max_tokens=n, stop=["a", "e"]),
            ]
        )
        mix.append((f"r{i}", prompt, params, rng.randint(0, 12)))
    return sorted(mix, key=lambda request: request[3])


def _run_mix(e: LLMEngine, seed: int) -> dict[str, tuple]:
    """Requests arriving over time and three aborts; the outputs of those not aborted."""
    pending, done, added, aborted = _random_mix(seed), {}, set(), set()
    rng = random.Random(seed + 99)
    aborts = {rng.randint(1, 30): f"r{rng.randint(0, 13)}" for _ in range(3)}
    calls = 0
    while pending or e.has_unfinished_requests():
        while pending and pending[0][3] <= calls:
            request_id, prompt, params, _ = pending.pop(0)
            e.add_request(request_id, {"prompt_token_ids": prompt}, params)
            added.add(request_id)
        calls += 1
        if aborts.get(calls) in added:
            e.abort_request(aborts[calls])
            aborted.add(aborts[calls])
        for output in e.step():
            assert output.request_id not in done and output.request_id not in aborted
            if output.finished:
                done[output.request_id] = _summary(output)
    assert_all_blocks_free(e)
    return {request_id: out for request_id, out in done.items() if request_id not in aborts.values()}


@pytest.mark.parametrize(("seed", "blocks", "mode"), [(1, 30, None), (3, 30, "recompute"), (7, 45, "swap")])
def test_a_random_mix_arriving_over_time_with_aborts_and_a_small_cache(tiny_llama, seed, blocks, mode):
    kwargs = dict(
        block_size=4,
        num_gpu_blocks_override=blocks,
        preemption_mode=mode,
        enable_prefix_caching=True,
        max_model_len=80,
        max_num_batched_tokens=48,
        max_num_seqs=6,
        swap_space=1,
    )
    off = _run_mix(LLMEngine(EngineConfig.from_kwargs(model=tiny_llama, device="cpu", **kwargs)), seed)
    e = LLMEngine(EngineConfig.from_kwargs(model=tiny_llama, device="cpu", async_scheduling=True, **kwargs))
    assert _run_mix(e, seed) == off
    assert e.pipeline.num_ahead > 0


@pytest.mark.parametrize("queued", [False, True], ids=["step-thread", "queued-in-caller"])
@pytest.mark.parametrize("rules", ["step=4", "request=poison", "sampler=poison"])
def test_a_fault_fails_its_requests_and_the_engine_goes_on(tiny_llama, monkeypatch, rules, queued):
    requests = {f"r{i}": (p, greedy(10)) for i, p in enumerate(PROMPTS[:6])}
    reference = run(engine(tiny_llama), requests)
    monkeypatch.setenv(FAULTS_ENV, rules)
    e = engine(tiny_llama, async_scheduling=True, worker_cls=WORKER)
    e.executor.queues_on_device = queued  # NOTE: True: as on a GPU, each step is launched in the caller's thread
    poisoned = dict(requests, **{"poison": (PROMPTS[7], greedy(10))})
    for request_id, (prompt, params) in poisoned.items():
        e.add_request(request_id, {"prompt_token_ids": prompt}, params)
    done = {}
    while e.has_unfinished_requests():
        for output in e.step():
            assert output.request_id not in done, "no output after a request finished"
            if output.finished:
                done[output.request_id] = output
    assert set(done) == set(poisoned)
    errors = {request_id for request_id, output in done.items() if output.error is not None}
    assert errors == ({"poison"} if "poison" in rules else errors) and errors
    for request_id in set(requests) - errors:
        assert _summary(done[request_id]) == reference[request_id], request_id
    assert_all_blocks_free(e)
    assert run(e, {f"again-{k}": v for k, v in requests.items()}) == {f"again-{k}": v for k, v in reference.items()}


def test_adapters_taking_turns_in_one_slot(tiny_llama, tmp_path):
    """max_loras=1: an adapter's slot goes to the next one while a step scheduled ahead may still use it."""
    adapters = [
        LoRARequest(f"a{i}", i + 1, save_random_adapter(tiny_llama, str(tmp_path / f"a{i}"), seed=i)) for i in range(2)
    ]
    batch = [(p, adapters[i % 3] if i % 3 < 2 else None) for i, p in enumerate(PROMPTS[:6])]
    outputs = {}
    for async_scheduling in (False, True):
        llm = LLM(
            model=tiny_llama,
            device="cpu",
            block_size=8,
            enable_lora=True,
            max_loras=1,
            async_scheduling=async_scheduling,
        )
        with llm:
            results = llm.generate(
                [{"prompt_token_ids": p} for p, _ in batch], greedy(8), lora_request=[a for _, a in batch]
            )
            assert_all_blocks_free(llm)
            assert not async_scheduling or llm.llm_engine.pipeline.num_ahead > 0
        outputs[async_scheduling] = [_summary(o) for o in results]
    assert outputs[True] == outputs[False]
    base = run(engine(tiny_llama), {f"r{i}": (p, greedy(8)) for i, (p, _) in enumerate(batch)})
    assert sum(outputs[True][i] != base[f"r{i}"] for i, (_, a) in enumerate(batch) if a is not None) >= 3


def test_speculative_decoding_turns_it_off(tiny_llama):
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
    requests = {f"r{i}": (p, greedy(12)) for i, p in enumerate(PROMPTS[:3])}
    off, on, e = both(tiny_llama, requests, speculative_config=spec)
    assert on == off and e.pipeline is None


def test_the_flag_parses_and_defaults_off():
    def parsed(*flags: str) -> bool:
        return engine_config_from_args(build_parser().parse_args(["serve", *flags])).scheduler.async_scheduling

    assert parsed() is False
    assert parsed("--async-scheduling") is True
    assert parsed("--async-scheduling", "--no-async-scheduling") is False
    assert EngineConfig.from_kwargs(async_scheduling=True).scheduler.async_scheduling
    assert EngineConfig.from_kwargs().scheduler.async_scheduling is False


def test_llm_takes_the_keyword_and_generates_the_same(tiny_llama):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    params = greedy(9)
    off = LLM(model=tiny_llama, device="cpu").generate(prompts, params)
    llm = LLM(model=tiny_llama, device="cpu", async_scheduling=True)
    on = llm.generate(prompts, params)
    assert [_summary(o) for o in on] == [_summary(o) for o in off]
    assert llm.llm_engine.pipeline is not None
    assert_all_blocks_free(llm)


def test_more_than_one_rank_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size > 1") as info:
        EngineConfig.from_kwargs(async_scheduling=True, tensor_parallel_size=2)
    assert isinstance(info.value, ConfigError) and info.value.field == "async_scheduling"


def test_the_serving_engine_streams_the_same_and_closed_streams_abort(tiny_llama):
    prompts = PROMPTS[:6]
    expected = run(engine(tiny_llama), {f"r{i}": (p, greedy(12)) for i, p in enumerate(prompts)})

    config = EngineConfig.from_kwargs(model=tiny_llama, device="cpu", block_size=8, async_scheduling=True)

    async def main() -> tuple[dict, int]:
        served = AsyncLLMEngine(config)
        served.start()
        await served.wait_until_ready(timeout=60)
        try:

            async def one(i: int):
                last = None
                stream = served.generate({"prompt_token_ids": prompts[i]}, greedy(12), f"r{i}")
                async for output in stream:
                    last = output
                    if i % 3 == 1 and len(output.outputs[0].token_ids) >= 3:
                        await stream.aclose()  # aborts the request
                        return None
                return last

            finished = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            for _ in range(500):
                if not await served.call(lambda e: e.has_unfinished_requests()):
                    break
                await asyncio.sleep(0.01)
            await served.call(assert_all_blocks_free)
            ahead = await served.call(lambda e: e.pipeline.num_ahead)
            return {f"r{i}": _summary(o) for i, o in enumerate(finished) if o is not None}, ahead
        finally:
            await served.shutdown()

    outputs, ahead = asyncio.run(asyncio.wait_for(main(), 120))
    assert set(outputs) == {"r0", "r2", "r3", "r5"} and ahead > 0
    assert outputs == {request_id: expected[request_id] for request_id in outputs}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_greedy_tokens_match_transformers(tiny_llama):
    """Pinned staging, non-blocking copies and placeholders filled on the device, against the oracle."""
    e = LLMEngine(EngineConfig.from_kwargs(model=tiny_llama, device="cuda", dtype="float32", async_scheduling=True))
    requests = {f"r{i}": (p, greedy(4 + 3 * i)) for i, p in enumerate(PROMPTS)}
    done = run(e, requests)
    assert e.pipeline.num_ahead > 0
    ref = HFReference(tiny_llama)
    for request_id, (prompt, params) in requests.items():
        ours = list(done[request_id][0][0])
        assert_greedy_matches(ref, prompt, ours, ref.greedy(prompt, params.max_tokens))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_step_scheduled_ahead_is_queued_without_waiting_for_the_device(tiny_llama, monkeypatch):
    """Launching a step scheduled ahead never waits for the GPU (torch's sync debug mode raises if
    it does): its inputs, the model, the draw and the copy of its tokens to the host are queued."""
    e = LLMEngine(EngineConfig.from_kwargs(model=tiny_llama, device="cuda", dtype="float32", async_scheduling=True))
    runner, checked = e.executor.driver, []
    launch, seen = runner.launch, [0]

    def watched(out):
        ahead = e.pipeline.num_ahead > seen[0]
        seen[0] = e.pipeline.num_ahead
        if ahead:
            torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(out)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(ahead)

    monkeypatch.setattr(runner, "launch", watched)
    done = run(e, {f"r{i}": (p, greedy(8)) for i, p in enumerate(PROMPTS[:4])})
    assert sorted(len(summary[0][0]) for summary in done.values()) == [8] * 4
    assert sum(checked) > 10
