"""Greedy tokens and logprobs against Hugging Face transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from engine_factories import HFReference, assert_greedy_matches, make_prompts

from pagedllm.server import LLM, SamplingParams
from pagedllm.server.config import DEFAULT_BLOCK_SIZES
from tests.support import assert_all_blocks_free

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def references(tiny_llama_dirs):
    return {name: HFReference(path) for name, path in tiny_llama_dirs.items()}


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(9, min_len=1, max_len=220)


@pytest.fixture(scope="module")
def expected(references, prompts):
    return {name: [ref.greedy(p, MAX_TOKENS) for p in prompts] for name, ref in references.items()}


def run_greedy(model_dir, prompts, **engine_args):
    llm = LLM(model=model_dir, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return llm, outputs


def check(references, expected, name, prompts, outputs):
    for prompt, want, out in zip(prompts, expected[name], outputs):
        assert_greedy_matches(references[name], prompt, out.outputs[0].token_ids, want)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("name", ["mha", "gqa"])
def test_greedy_matches_transformers(tiny_llama_dirs, references, expected, prompts, name, backend):
    llm, outputs = run_greedy(tiny_llama_dirs[name], prompts, block_size=16, attention_backend=backend)
    assert llm.llm_engine.runner.ops.name == backend
    check(references, expected, name, prompts, outputs)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_the_cpus_default_block_size_matches_transformers(tiny_llama_dirs, references, expected, prompts, backend):
    llm, outputs = run_greedy(tiny_llama_dirs["gqa"], prompts, attention_backend=backend)
    engine = llm.llm_engine
    assert engine.config.cache.block_size == engine.block_manager.block_size == DEFAULT_BLOCK_SIZES["cpu"] == 64
    assert engine.stats().block_size == 64 and engine.runner.block_size == 64
    check(references, expected, "gqa", prompts, outputs)
    assert_all_blocks_free(llm)


def test_cpu_float32_defaults_to_the_compiled_decode_kernel(tiny_llama_dirs):
    llm = LLM(model=tiny_llama_dirs["gqa"], num_gpu_blocks_override=8)
    assert llm.llm_engine.runner.ops.name == "numba"


def test_logprobs_close_to_transformers(tiny_llama_dirs, references, expected, prompts):
    llm, outputs = run_greedy(tiny_llama_dirs["gqa"], prompts[:4], block_size=8)
    ref = references["gqa"]
    for prompt, out in zip(prompts[:4], outputs):
        tokens = out.outputs[0].token_ids
        lp = ref.logprobs(prompt + tokens)[len(prompt) - 1 : -1]
        want = lp[torch.arange(len(tokens)), torch.tensor(tokens)]
        got = torch.tensor([out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(tokens)])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert out.outputs[0].cumulative_logprob == pytest.approx(float(want.sum()), abs=1e-3)


def test_chunked_prefill_matches(tiny_llama_dirs, references, expected, prompts):
    llm, outputs = run_greedy(tiny_llama_dirs["gqa"], prompts, block_size=16, max_num_batched_tokens=64)
    assert max(len(p) for p in prompts) > 64
    check(references, expected, "gqa", prompts, outputs)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches(tiny_llama_dirs, references, expected, prompts, mode):
    # 40 blocks of 8 tokens: the longest prompt fits alone, the batch does not.
    llm, outputs = run_greedy(
        tiny_llama_dirs["gqa"],
        prompts,
        block_size=8,
        num_gpu_blocks_override=40,
        preemption_mode=mode,
        max_num_batched_tokens=128,
    )
    assert llm.llm_engine.stats().num_preemptions > 0
    check(references, expected, "gqa", prompts, outputs)
    assert_all_blocks_free(llm)


def test_prefix_caching_matches_and_hits(tiny_llama_dirs, references):
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 256, (70,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 5, 17, 33)]
    ref = references["gqa"]
    llm = LLM(model=tiny_llama_dirs["gqa"], block_size=16, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
    stats = llm.llm_engine.stats()
    assert stats.prefix_cache_hits >= 3 * 64
    for prompt, out in zip(prompts, first + rest):
        assert_greedy_matches(ref, prompt, out.outputs[0].token_ids, ref.greedy(prompt, MAX_TOKENS))
    assert_all_blocks_free(llm)


def test_triton_and_numba_backends_match_torch_backend(tiny_llama_dirs):
    """The engine's greedy tokens are the same through the Triton kernels (interpreter on CPU)
    and the compiled CPU decode kernel."""
    prompts = make_prompts(3, min_len=3, max_len=40, seed=5)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton", "numba"):
        llm = LLM(
            model=tiny_llama_dirs["gqa"],
            block_size=8,
            num_gpu_blocks_override=32,
            attention_backend=backend,
            max_num_batched_tokens=32,
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs[backend] = [o.outputs[0].token_ids for o in outs]
        assert llm.llm_engine.runner.ops.name == backend
    assert runs["triton"] == runs["torch"] == runs["numba"]


def test_prefix_caching_on_and_off_give_identical_tokens(tiny_llama_dirs):
    """Partial last blocks, exact block-aligned prefixes and eviction under a tight cache."""
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, 256, (48,), generator=g).tolist()  # exactly 6 blocks of 8
    prompts = [shared] + [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 7, 8, 9, 30)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runs = {}
    for caching in (False, True):
        llm = LLM(model=tiny_llama_dirs["mha"], block_size=8, num_gpu_blocks_override=24, enable_prefix_caching=caching)
        runs[caching] = [
            o.outputs[0].token_ids for p in prompts for o in llm.generate([{"prompt_token_ids": p}] * 2, params)
        ]
        assert_all_blocks_free(llm)
        assert (llm.llm_engine.stats().prefix_cache_hits > 0) == caching
    assert runs[True] == runs[False]
