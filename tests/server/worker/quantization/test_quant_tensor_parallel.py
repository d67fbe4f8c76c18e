"""Quantized checkpoints split over two CPU ranks (gloo): packed columns and group scales cut with their features."""

from __future__ import annotations

import pytest
from engine_factories import HFReference, assert_greedy_matches, make_prompts
from quant_writers import write_online, write_quantized

from pagedllm.server import LLM, SamplingParams

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # NOTE: ranks share two cores here


@pytest.mark.parametrize(
    ("fmt", "options"),
    [
        ("awq", {"group": 32}),
        ("gptq", {"family": "qwen2", "group": -1}),  # NOTE: its MLP (96) leaves 48 inputs a rank: no group fits
        ("gptq", {"desc_act": True, "sym": False}),
        ("ct-pack", {}),
    ],
)
def test_two_ranks_match_transformers_on_the_twin(tmp_path, fmt, options):
    qdir, twin = write_quantized(str(tmp_path), fmt, seed=11, **options)
    ref = HFReference(twin)
    prompts = make_prompts(4, min_len=1, max_len=50, seed=2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model=qdir, tensor_parallel_size=2, block_size=8, num_gpu_blocks_override=64) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs):
        assert_greedy_matches(ref, prompt, out.outputs[0].token_ids, ref.greedy(prompt, 8))


def test_two_ranks_quantize_online_like_one(tmp_path):
    plain, twin = write_online(str(tmp_path), "int8", seed=3)
    ref = HFReference(twin)
    prompts = make_prompts(3, min_len=1, max_len=40, seed=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model=plain, quantization="int8", tensor_parallel_size=2, num_gpu_blocks_override=64) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs):
        assert_greedy_matches(ref, prompt, out.outputs[0].token_ids, ref.greedy(prompt, 8))
