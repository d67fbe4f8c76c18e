"""Mistral with a sliding window, prompts several windows long: greedy tokens against transformers."""

from __future__ import annotations

import pytest
import torch
from engine_factories import HFReference, assert_greedy_matches, save_tiny_mistral

from pagedllm.server import LLM, SamplingParams

WINDOW = 24
MAX_TOKENS = 40  # decoding crosses several blocks and windows too


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> str:
    return save_tiny_mistral(str(tmp_path_factory.mktemp("tiny-mistral")), seed=3, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def reference(mistral_dir) -> HFReference:
    return HFReference(mistral_dir)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (60, 97, 131, 200)]


@pytest.fixture(scope="module")
def expected(reference, prompts) -> list[list[int]]:
    return [reference.greedy(p, MAX_TOKENS) for p in prompts]


def run_greedy(model_dir: str, prompts: list[list[int]], **engine_args):
    llm = LLM(model=model_dir, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def check(reference, prompts, expected, outputs) -> None:
    for prompt, want, out in zip(prompts, expected, outputs):
        assert_greedy_matches(reference, prompt, out.outputs[0].token_ids, want)


def assert_all_blocks_free(llm) -> None:
    stats = llm.llm_engine.stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.block_manager.check_invariants() == []


def test_the_reference_applies_the_window(mistral_dir, reference, prompts, expected):
    """Without its window the same weights continue differently: the window is what is tested."""
    from transformers import AutoModelForCausalLM

    unwindowed = HFReference(mistral_dir)
    unwindowed.model = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32, sliding_window=None)
    assert reference.model.config.sliding_window == WINDOW
    assert unwindowed.model.config.sliding_window is None
    assert [unwindowed.greedy(p, MAX_TOKENS) for p in prompts] != expected


def test_max_model_len_is_not_capped_at_the_window(mistral_dir):
    llm = LLM(model=mistral_dir, block_size=16)
    assert llm.llm_engine.max_model_len == 512
    assert llm.llm_engine.model_info.kv_window == WINDOW


@pytest.mark.parametrize("backend", ["numba", "torch", "triton"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_greedy_matches_transformers(mistral_dir, reference, prompts, expected, backend, block_size):
    llm, outputs = run_greedy(mistral_dir, prompts, block_size=block_size, attention_backend=backend)
    assert llm.llm_engine.runner.ops.name == backend
    check(reference, prompts, expected, outputs)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_chunked_prefill_matches(mistral_dir, reference, prompts, expected, backend):
    """Chunks of 20 tokens: each chunk's first query reaches back into the previous chunks."""
    llm, outputs = run_greedy(mistral_dir, prompts, block_size=8, max_num_batched_tokens=20, attention_backend=backend)
    check(reference, prompts, expected, outputs)
    assert_all_blocks_free(llm)


def test_prefix_caching_matches_and_hits(mistral_dir, reference):
    """A shared prefix of 9 blocks (several windows): later prompts start past the window of it."""
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(0, 256, (72,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 9, 30, 70)]
    llm = LLM(model=mistral_dir, block_size=8, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
    assert llm.llm_engine.stats().prefix_cache_hits >= 3 * 72
    for prompt, out in zip(prompts, first + rest):
        assert_greedy_matches(reference, prompt, out.outputs[0].token_ids, reference.greedy(prompt, MAX_TOKENS))
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches(mistral_dir, reference, prompts, expected, mode):
    """A cache that holds the longest sequence alone but not the batch."""
    llm, outputs = run_greedy(
        mistral_dir,
        prompts,
        block_size=8,
        num_gpu_blocks_override=40,
        preemption_mode=mode,
        max_num_batched_tokens=64,
    )
    assert llm.llm_engine.stats().num_preemptions > 0
    check(reference, prompts, expected, outputs)
    assert_all_blocks_free(llm)
