"""Tensor parallelism on CPU (gloo): the same tokens and logprobs as one rank and as transformers,
under preemption, sampling, beam search and prefix caching; dead or hung ranks end the engine
with their name; nothing is left running afterwards."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import time
import weakref

import httpx
import pytest
import torch
from api_factories import serve_process
from engine_factories import HFReference, assert_greedy_matches, make_prompts, save_tiny
from fault_doubles import FAULTS_ENV, WORKER

from pagedllm.server import LLM, SamplingParams
from pagedllm.server.demo import save_tiny_llama
from pagedllm.server.engine.faults import EngineFatalError
from pagedllm.server.engine.llm_engine import EngineClosedError

pytestmark = pytest.mark.timeout(600)
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_rank():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")  # NOTE: ranks share two cores here
        yield


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-models")
    heads = dict(hidden_size=64, intermediate_size=128, initializer_range=0.2)
    return {
        "llama-mha": save_tiny_llama(str(root / "mha"), seed=1, num_attention_heads=4, num_key_value_heads=4, **heads),
        "llama-gqa": save_tiny_llama(str(root / "gqa"), seed=2, num_attention_heads=8, num_key_value_heads=2, **heads),
        "opt": save_tiny(str(root / "opt"), "opt", seed=3, do_layer_norm_before=True),
        "gpt2": save_tiny(str(root / "gpt2"), "gpt2", seed=4),
    }


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(5, min_len=1, max_len=60, seed=5)


def generate(model: str, prompts, params=GREEDY, **engine_args):
    llm = LLM(model=model, block_size=8, **{"num_gpu_blocks_override": 128, **engine_args})
    with llm:
        return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def same_outputs(a, b, logprob_tol=1e-4):
    for x, y in zip(a, b):
        for cx, cy in zip(x.outputs, y.outputs):
            assert cx.token_ids == cy.token_ids
            if cx.cumulative_logprob is None or cy.cumulative_logprob is None:  # greedy without logprobs
                assert cx.cumulative_logprob is None and cy.cumulative_logprob is None
                continue
            assert abs(cx.cumulative_logprob - cy.cumulative_logprob) < logprob_tol * max(1, len(cx.token_ids))


def child_processes(of: int | None = None) -> list[int]:
    """Live children of this process, from /proc (multiprocessing's resource tracker, started once
    per interpreter by the spawn context and gone with it, is not a worker)."""
    me = str(of or os.getpid())
    children = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().split(") ", 1)[1].split()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z" and b"resource_tracker" not in cmdline:
                children.append(int(pid))
    return children


@pytest.mark.parametrize("name, size", [("llama-mha", 2), ("llama-gqa", 4), ("opt", 2), ("gpt2", 2)])
def test_tokens_and_logprobs_equal_one_rank_and_transformers(models, prompts, name, size):
    _, one = generate(models[name], prompts)
    _, many = generate(models[name], prompts, tensor_parallel_size=size)
    same_outputs(one, many)
    reference = HFReference(models[name])
    for prompt, out in zip(prompts, many):
        assert_greedy_matches(reference, prompt, out.outputs[0].token_ids, reference.greedy(prompt, MAX_TOKENS))
    assert child_processes() == []


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_sampling_and_beams_at_two_ranks(models, prompts, mode):
    tight = dict(num_gpu_blocks_override=12, preemption_mode=mode, max_num_seqs=8)
    params = [
        SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    ]
    for p in params:
        llm_one, one = generate(models["llama-gqa"], prompts, p, **tight)
        llm_two, two = generate(models["llama-gqa"], prompts, p, tensor_parallel_size=2, **tight)
        same_outputs(one, two, logprob_tol=1e-3)
        assert llm_two.llm_engine.stats().num_preemptions > 0


def test_only_the_driver_samples(models, monkeypatch):
    with LLM(model=models["llama-mha"], block_size=8, num_gpu_blocks_override=64, tensor_parallel_size=2) as llm:
        runner, others = llm.llm_engine.runner, llm.llm_engine.executor.remote
        sent = []
        send = others.send

        def noting(message):
            if message[0] == "step":
                sent.append(message[1])
            send(message)

        monkeypatch.setattr(others, "send", noting)
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=4, ignore_eos=True, logprobs=1)
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params)[0].outputs[0]
        assert len(out.token_ids) == 4 and len(out.logprobs) == 4 and runner.sampler is not None
        assert len(sent) == 4 and all(step.sampling is None for step in sent)  # the other ranks never sample


def test_prefix_caching_hits_at_two_ranks(models):
    shared = list(range(1, 33))
    prompts = [shared + [40 + i] for i in range(4)]
    with LLM(model=models["llama-mha"], block_size=8, num_gpu_blocks_override=128, tensor_parallel_size=2) as llm:
        outs = [llm.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in prompts]  # one after another
        assert llm.llm_engine.stats().prefix_cache_hits == 3 * 32
    _, one = generate(models["llama-mha"], prompts, enable_prefix_caching=False)
    same_outputs(one, outs)


def test_an_impossible_size_is_refused_before_any_rank_starts(models):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 is not allowed: a divisor of the model's number"):
        LLM(model=models["llama-mha"], tensor_parallel_size=3)
    assert child_processes() == []


@pytest.mark.parametrize("fault, message", [("die", "rank 1 .* exited with code 3"), ("hang", "did not finish")])
def test_a_dead_or_hung_rank_ends_the_engine_naming_it(models, monkeypatch, fault, message):
    monkeypatch.setenv("PAGEDLLM_TP_HANG_TIMEOUT", "3")
    monkeypatch.setenv(FAULTS_ENV, f"{fault}=1")  # rank 1 dies or hangs in its first step
    llm = LLM(model=models["llama-mha"], tensor_parallel_size=2, num_gpu_blocks_override=64, worker_cls=WORKER)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, GREEDY)
    started = time.monotonic()
    with pytest.raises(EngineFatalError, match=message):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - started < 20
    engine.shutdown()
    assert child_processes() == []


@pytest.fixture()
def no_gc():
    """Only reference counting frees objects while the test runs: what it releases is released without a gc pass."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def assert_released() -> None:
    """No rank process is left and the process group is gone, at once (no waiting)."""
    assert child_processes() == [] and multiprocessing.active_children() == []
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("release", ["del", "shutdown", "with"])
def test_a_released_tp_llm_lets_the_next_one_start(models, no_gc, release):
    short = [{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": [9, 8, 7]}]
    args = dict(model=models["llama-mha"], tensor_parallel_size=2, num_gpu_blocks_override=64)
    tokens = []
    for _ in range(2):
        if release == "with":
            with LLM(**args) as llm:
                assert len(child_processes()) == 1
                tokens.append([o.outputs[0].token_ids for o in llm.generate(short, GREEDY)])
        else:
            llm = LLM(**args)
            assert len(child_processes()) == 1
            tokens.append([o.outputs[0].token_ids for o in llm.generate(short, GREEDY)])
            if release == "shutdown":
                llm.shutdown()
                llm.shutdown()  # idempotent
            else:
                del llm
        assert_released()
        if release != "del":
            with pytest.raises(EngineClosedError, match="the engine was shut down"):
                llm.generate(short, GREEDY)
    assert tokens[0] == tokens[1] and all(len(t) == MAX_TOKENS for t in tokens[0])


def test_shutting_down_a_one_rank_llm_frees_its_cache(models):
    llm = LLM(model=models["llama-mha"], num_gpu_blocks_override=64)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY)
    runner = llm.llm_engine.runner
    caches = [weakref.ref(t) for pair in runner.kv_caches + runner.host_caches for t in pair]
    llm.shutdown()
    assert runner.kv_caches == [] and runner.host_caches == []
    assert all(ref() is None for ref in caches), "a KV cache tensor is still referenced after shutdown"
    with pytest.raises(EngineClosedError, match="build a new one"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY)
    llm.shutdown()


def test_serve_with_two_ranks_answers_the_openai_client(models):
    from openai import OpenAI

    with serve_process(models["llama-mha"], "--tensor-parallel-size", "2") as (proc, url):
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        out = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=5, temperature=0)
        assert len(out.choices[0].text) > 0 and out.usage.completion_tokens == 5
        assert httpx.get(f"{url}/health").status_code == 200
        ranks = child_processes(of=proc.pid)
        assert len(ranks) == 1  # rank 1; rank 0 is the server itself
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in ranks), "a rank outlived the server"


def test_the_triton_backend_at_two_ranks(models):
    """The ranks run the Triton kernels too (through the interpreter on CPU, inherited by the spawned ranks)."""
    short = [[1, 2, 3, 4, 5], [9, 8, 7]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    _, one = generate(models["llama-gqa"], short, params, attention_backend="triton")
    llm, two = generate(models["llama-gqa"], short, params, attention_backend="triton", tensor_parallel_size=2)
    assert llm.llm_engine.runner.ops.name == "triton"
    same_outputs(one, two)
