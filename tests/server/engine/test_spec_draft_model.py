"""Speculative decoding with a draft model: the target's greedy tokens on every CPU backend and
at TP 2, seeded sampling unchanged, preemption and prefix caching intact, no slot leaked; the
draft's own KV cache kept current (the target as its own draft accepts nearly everything)."""

from __future__ import annotations

import pytest
import torch
from engine_factories import HFReference
from spec_factories import GREEDY, assert_same_greedy, copying_prompts, engine, run

from pagedllm.server import SamplingParams
from pagedllm.server.config import ConfigError, SpeculativeConfig
from pagedllm.server.demo import save_tiny_llama
from pagedllm.server.engine.spec_decode.draft_model import DraftState


def draft_config(model: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return copying_prompts()


@pytest.fixture(scope="module")
def reference(tiny_llama) -> HFReference:
    return HFReference(tiny_llama)


@pytest.fixture(scope="module")
def plain(tiny_llama, prompts) -> list[list[int]]:
    return run(engine(tiny_llama), prompts, GREEDY)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> str:
    """A random model of the same vocabulary that predicts the target badly."""
    return save_tiny_llama(str(tmp_path_factory.mktemp("draft") / "d"), seed=7, num_hidden_layers=1)


def acceptance(e) -> float:
    stats = e.stats().spec_decode
    assert stats is not None and stats.num_draft_tokens > 0
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    return stats.num_accepted_tokens / stats.num_draft_tokens


@pytest.mark.parametrize("backend", ["numba", "torch", "triton"])
def test_the_target_as_its_own_draft_gives_its_tokens_and_is_accepted(tiny_llama, prompts, plain, reference, backend):
    """A draft whose cache fell behind or pointed at the wrong slots would be rejected often."""
    e = engine(tiny_llama, attention_backend=backend, speculative_config=draft_config(tiny_llama))
    picked = range(len(prompts)) if backend != "triton" else (0, 4)  # NOTE: the Triton interpreter is slow
    some = [prompts[i] for i in picked]
    num = GREEDY.max_tokens if backend != "triton" else 10
    ours = run(e, some, SamplingParams(temperature=0, max_tokens=num, ignore_eos=True))
    assert_same_greedy(reference, some, ours, [plain[i][:num] for i in picked])
    assert acceptance(e) > 0.9


def test_a_poor_draft_changes_nothing_and_pauses(tiny_llama, other_draft, prompts, plain, reference):
    e = engine(tiny_llama, speculative_config=draft_config(other_draft))
    ours = run(e, prompts, GREEDY)
    assert_same_greedy(reference, prompts, ours, plain)
    stats = e.stats().spec_decode
    # NOTE: rejected drafts pause a request's proposals, so far fewer drafts than decode steps
    assert stats.num_drafts < len(prompts) * GREEDY.max_tokens / 2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_tight_cache(tiny_llama, prompts, plain, reference, mode):
    spec = draft_config(tiny_llama)
    e = engine(tiny_llama, num_gpu_blocks_override=40, preemption_mode=mode, speculative_config=spec)
    ours = run(e, prompts, GREEDY)
    assert e.scheduler.num_preemptions > 0
    assert_same_greedy(reference, prompts, ours, plain)
    assert acceptance(e) > 0.8


def test_prefix_caching_keeps_tokens_and_the_draft_current(tiny_llama, prompts, plain, reference):
    e = engine(tiny_llama, enable_prefix_caching=True, speculative_config=draft_config(tiny_llama))
    ours = run(e, prompts, GREEDY)
    again = run(e, prompts, GREEDY)
    assert again == ours and e.stats().prefix_cache_hits > 0
    assert_same_greedy(reference, prompts, ours, plain)
    assert acceptance(e) > 0.9


def test_seeded_sampling_is_unchanged_by_a_draft(tiny_llama, other_draft, prompts):
    """Draft proposals are greedy, one-hot drafts: acceptance uses one draw per emitted token, as sampling does."""
    params = [
        SamplingParams(temperature=0.3, top_p=0.9, seed=100 + i, max_tokens=24, ignore_eos=True)
        for i in range(len(prompts))
    ]
    base = run(engine(tiny_llama), prompts, params)
    for draft in (tiny_llama, other_draft):
        e = engine(tiny_llama, speculative_config=draft_config(draft))
        assert run(e, prompts, params) == base


@pytest.mark.timeout(600)
def test_greedy_tokens_at_two_ranks(tiny_llama, prompts, plain, reference):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        e = engine(tiny_llama, tensor_parallel_size=2, speculative_config=draft_config(tiny_llama))
        try:
            ours = run(e, prompts[:6], GREEDY)
            assert acceptance(e) > 0.9
        finally:
            e.shutdown()
    assert_same_greedy(reference, prompts[:6], ours, plain[:6])


def test_the_draft_cache_shares_the_memory_budget(tiny_llama):
    """Without an override, the target and the draft split the KV memory, block for block."""
    alone = engine(tiny_llama, num_gpu_blocks_override=None, kv_cache_memory=0.01)
    both = engine(
        tiny_llama, num_gpu_blocks_override=None, kv_cache_memory=0.01, speculative_config=draft_config(tiny_llama)
    )
    assert both.block_manager.gpu.num_blocks == alone.block_manager.gpu.num_blocks // 2
    assert both.draft is not None and len(both.draft.runner.kv_caches[0][0]) == both.block_manager.gpu.num_blocks
    assert f"speculative      draft model {tiny_llama}, 4 tokens" in both.describe()


def test_the_draft_computes_in_the_targets_dtype(tiny_llama, other_draft):
    e = engine(tiny_llama, dtype="bfloat16", speculative_config=draft_config(other_draft))
    assert e.runner.dtype == e.draft.runner.dtype == torch.bfloat16


def test_draft_state_is_dropped_when_the_blocks_moved():
    state = DraftState(computed=10, blocks=(7, 9, 3, 5))
    assert state.valid_prefix([7, 9, 3], block_size=4) == 10
    assert state.valid_prefix([7, 9, 3, 8, 1], block_size=4) == 10  # later blocks are not read
    assert state.valid_prefix([7, 2, 3], block_size=4) == 0  # copy-on-write or a new home
    assert state.valid_prefix([], block_size=4) == 0
    assert DraftState().valid_prefix([4], block_size=4) == 0


def test_bad_draft_configs_are_refused(tiny_llama, tmp_path):
    with pytest.raises(ConfigError, match="speculative_config.model=None is required with method draft_model"):
        SpeculativeConfig.parse({"method": "draft_model"})
    with pytest.raises(ConfigError, match="speculative_config.model=.* is only for draft_model"):
        SpeculativeConfig.parse({"method": "ngram", "model": tiny_llama})
    other = save_tiny_llama(str(tmp_path / "v"), vocab_size=300)
    with pytest.raises(ConfigError, match="has another vocabulary: .* 300 tokens, the target's 259"):
        engine(tiny_llama, speculative_config=draft_config(other))
    with pytest.raises(ValueError, match="is not a model directory"):
        engine(tiny_llama, speculative_config=draft_config(str(tmp_path / "missing")))
