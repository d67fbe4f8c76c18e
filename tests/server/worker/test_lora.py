"""Batched multi-LoRA serving against transformers + peft with each adapter merged into the base.

Adapters are random PEFT adapters (non-zero B) on tiny LLaMA and Qwen2 checkpoints; one
batch mixes several adapters and the base model, at one and two tensor-parallel ranks.
"""

from __future__ import annotations

import pytest
import torch
from engine_factories import HFReference, assert_greedy_matches, make_prompts
from family_factories import save_tiny_family
from lora_factories import save_random_adapter

from pagedllm.server import LLM, LoRARequest, SamplingParams
from pagedllm.server.config import ConfigError
from pagedllm.server.demo import save_tiny_llama
from tests.support import assert_all_blocks_free

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# name -> (rank, alpha, targets, extra LoraConfig arguments)
ADAPTERS = {
    "all-r8": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), {}),
    "attn-r4-rslora": (4, 8, ("q_proj", "k_proj", "v_proj", "o_proj"), {"use_rslora": True}),
    "mlp-r16": (16, 4, ("gate_proj", "up_proj", "down_proj"), {"alpha_pattern": {"down_proj": 32}}),
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _base(family: str, path: str) -> str:
    if family == "llama":
        shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2)
        return save_tiny_llama(path, seed=1, initializer_range=0.2, **shape)
    return save_tiny_family(path, "qwen2", seed=2)


@pytest.fixture(scope="module")
def setups(tmp_path_factory) -> dict[str, dict]:
    """family -> base dir, its references (base and merged, per adapter) and the adapters' requests."""
    out = {}
    for family in ("llama", "qwen2"):
        root = tmp_path_factory.mktemp(f"lora-{family}")
        base = _base(family, str(root / "base"))
        requests, references = {}, {"base": HFReference(base)}
        for lora_id, (name, (rank, alpha, targets, extra)) in enumerate(ADAPTERS.items(), start=1):
            merged = str(root / f"merged-{name}")
            path = save_random_adapter(
                base,
                str(root / name),
                seed=lora_id,
                rank=rank,
                alpha=alpha,
                targets=targets,
                merged_dir=merged,
                **extra,
            )
            requests[name] = LoRARequest(name, lora_id, path)
            references[name] = HFReference(merged)
        out[family] = {"base": base, "requests": requests, "references": references, "root": root}
    return out


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(4, min_len=3, max_len=40, seed=7)


def mixed_batch(setup, prompts):
    """Every prompt under every adapter and the base model, interleaved: (prompt, adapter name or 'base')."""
    names = ["base", *ADAPTERS]
    return [(p, names[(i + j) % len(names)]) for i, p in enumerate(prompts) for j in range(2)]


def run(llm, setup, batch):
    loras = [setup["requests"].get(name) for _, name in batch]
    return llm.generate([{"prompt_token_ids": p} for p, _ in batch], GREEDY, lora_request=loras)


def check(setup, batch, outputs):
    for (prompt, name), out in zip(batch, outputs):
        ref = setup["references"][name]
        assert_greedy_matches(ref, prompt, out.outputs[0].token_ids, ref.greedy(prompt, MAX_TOKENS))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_mixed_batch_matches_merged_peft(setups, prompts, family):
    setup = setups[family]
    batch = mixed_batch(setup, prompts)
    with LLM(model=setup["base"], enable_lora=True, max_loras=3, block_size=8, num_gpu_blocks_override=96) as llm:
        outputs = run(llm, setup, batch)
        check(setup, batch, outputs)
        assert_all_blocks_free(llm)
    # NOTE: the adapters really change the answers, so equal tokens are not the base model's by accident.
    base_ref = setup["references"]["base"]
    changed = [
        out.outputs[0].token_ids != base_ref.greedy(p, MAX_TOKENS)
        for (p, name), out in zip(batch, outputs)
        if name != "base"
    ]
    assert sum(changed) >= len(changed) - 1


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_two_tensor_parallel_ranks_match_merged_peft(setups, prompts, family, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    setup = setups[family]
    batch = mixed_batch(setup, prompts[:3])
    llm = LLM(model=setup["base"], enable_lora=True, max_loras=3, tensor_parallel_size=2, block_size=8)
    with llm:
        check(setup, batch, run(llm, setup, batch))


@pytest.mark.slow
def test_triton_kernels_in_the_engine_match_merged_peft(setups, prompts):
    """The Triton LoRA kernels run where attention runs Triton (here through the interpreter, in float32)."""
    setup = setups["qwen2"]
    batch = [(prompts[0], "base"), (prompts[0], "all-r8"), (prompts[1], "mlp-r16")]
    llm = LLM(model=setup["base"], enable_lora=True, max_loras=2, attention_backend="triton", dtype="float32")
    with llm:
        assert llm.llm_engine.runner.lora._use_triton
        check(setup, batch, run(llm, setup, batch))


def test_one_slot_evicts_and_reloads_adapters(setups, prompts):
    """max_loras=1: two adapters in one batch take turns in the slot (the second waits), then alternate."""
    setup = setups["llama"]
    batch = [(p, name) for p in prompts[:2] for name in ("all-r8", "mlp-r16", "base")]
    llm = LLM(model=setup["base"], enable_lora=True, max_loras=1, block_size=8, num_gpu_blocks_override=96)
    with llm:
        check(setup, batch, run(llm, setup, batch))
        lora = llm.llm_engine.runner.lora
        for name in ("all-r8", "mlp-r16", "all-r8"):
            one = [(prompts[2], name)]
            check(setup, one, run(llm, setup, one))
            assert lora.resident[1] == setup["requests"][name]
        assert_all_blocks_free(llm)


def test_adapters_never_share_prefix_blocks(setups, prompts):
    """The same prompt under two adapters and the base: every answer is its own model's, however cached."""
    setup = setups["llama"]
    prompt = prompts[-1] + prompts[-2]
    batch = [(prompt, name) for name in ("all-r8", "attn-r4-rslora", "base", "all-r8")]
    llm = LLM(model=setup["base"], enable_lora=True, max_loras=2, block_size=8, num_gpu_blocks_override=96)
    with llm:
        for item in batch:  # one at a time, so each finds the previous one's blocks cached
            check(setup, [item], run(llm, setup, [item]))
        stats = llm.llm_engine.stats()
    # NOTE: hits count tokens; only the repeated adapter found its full prompt blocks.
    assert stats.prefix_cache_hits == (len(prompt) - 1) // 8 * 8


def test_wrong_base_adapter_is_refused(setups, tmp_path):
    other = save_tiny_llama(str(tmp_path / "other"), seed=3, hidden_size=32, intermediate_size=64)
    path = save_random_adapter(other, str(tmp_path / "wrong"), seed=9)
    setup = setups["llama"]
    with LLM(model=setup["base"], enable_lora=True, block_size=8, num_gpu_blocks_override=32) as llm:
        with pytest.raises(
            ConfigError,
            match=r"does not fit the loaded model: model\.layers\.\d\.\w+_proj has lora_A .* maps \d+ -> \d+",
        ) as info:
            llm.generate([[1, 2, 3]], GREEDY, lora_request=LoRARequest("wrong", 7, path))
        assert info.value.field == "lora_request"
        assert not llm.llm_engine.has_unfinished_requests()


def test_adapter_above_max_lora_rank_is_refused(setups):
    setup = setups["llama"]
    with LLM(model=setup["base"], enable_lora=True, max_lora_rank=8, num_gpu_blocks_override=32) as llm:
        with pytest.raises(ConfigError, match="rank 16 .* above the limit: at most max_lora_rank=8"):
            llm.generate([[1, 2, 3]], GREEDY, lora_request=setup["requests"]["mlp-r16"])


def test_lora_request_needs_enable_lora(setups):
    setup = setups["llama"]
    with LLM(model=setup["base"], num_gpu_blocks_override=32) as llm:
        with pytest.raises(ConfigError, match="needs LoRA, which is off"):
            llm.generate([[1, 2, 3]], GREEDY, lora_request=setup["requests"]["all-r8"])


def test_one_id_names_one_adapter(setups):
    setup = setups["llama"]
    first = setup["requests"]["all-r8"]
    with LLM(model=setup["base"], enable_lora=True, num_gpu_blocks_override=32) as llm:
        llm.generate([[1, 2, 3]], GREEDY, lora_request=first)
        clash = LoRARequest("other", first.lora_int_id, setup["requests"]["mlp-r16"].lora_path)
        with pytest.raises(ConfigError, match="lora_int_id=1 is already in use"):
            llm.generate([[1, 2, 3]], GREEDY, lora_request=clash)


def test_unsupported_model_family_is_refused(tmp_path):
    from engine_factories import save_tiny

    path = save_tiny(str(tmp_path / "opt"), "opt", seed=0)
    with pytest.raises(ConfigError, match="enable_lora=True is not supported for OPTForCausalLM"):
        LLM(model=path, enable_lora=True, num_gpu_blocks_override=8)
