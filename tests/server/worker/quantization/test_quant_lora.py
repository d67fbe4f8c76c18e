"""LoRA adapters on a quantized base: the adapter's term is added to the quantized projection's output."""

from __future__ import annotations

import pytest
from engine_factories import HFReference, assert_greedy_matches, make_prompts
from lora_factories import save_random_adapter
from quant_writers import write_quantized

from pagedllm.server import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 8


@pytest.mark.parametrize("tp", [1, 2])
def test_adapters_on_an_awq_base_match_the_merged_twin(tmp_path, monkeypatch, tp):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # NOTE: ranks share two cores here
    qdir, twin = write_quantized(str(tmp_path), "awq", seed=5)
    merged = str(tmp_path / "merged")
    adapter = save_random_adapter(twin, str(tmp_path / "adapter"), seed=3, rank=8, merged_dir=merged)
    prompts = make_prompts(4, min_len=2, max_len=40, seed=9)
    refs = {"base": HFReference(twin), "lora": HFReference(merged)}
    batch = [(p, name) for p in prompts for name in ("base", "lora")]
    request = LoRARequest("lora", 1, adapter)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(
        model=qdir, enable_lora=True, max_loras=1, tensor_parallel_size=tp, block_size=8, num_gpu_blocks_override=64
    ) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p, _ in batch],
            params,
            lora_request=[request if name == "lora" else None for _, name in batch],
        )
    changed = 0
    for (prompt, name), out in zip(batch, outputs):
        ref = refs[name]
        want = ref.greedy(prompt, MAX_TOKENS)
        assert_greedy_matches(ref, prompt, out.outputs[0].token_ids, want)
        changed += name == "lora" and want != refs["base"].greedy(prompt, MAX_TOKENS)
    assert changed >= len(prompts) - 1  # NOTE: the adapter really changes the answers
