"""The prefix cache never hands one tenant's blocks to another, nor one prompt's KV to a different prompt."""

from __future__ import annotations

import pytest

from pagedllm.server import LLM, SamplingParams
from pagedllm.server.core import prefix_cache

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(1, 41))  # five full blocks of 8


@pytest.fixture
def llm(tiny_llama):
    return LLM(model=tiny_llama, block_size=8, num_gpu_blocks_override=128, enable_prefix_caching=True)


def hits_of(llm: LLM, prompt: dict) -> tuple[int, list[int]]:
    before = llm.llm_engine.stats().prefix_cache_hits
    (output,) = llm.generate([prompt], PARAMS)
    return llm.llm_engine.stats().prefix_cache_hits - before, output.outputs[0].token_ids


def test_same_salt_shares_and_different_salts_do_not(llm):
    assert hits_of(llm, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"})[0] == 0
    assert hits_of(llm, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"})[0] == 32
    assert hits_of(llm, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-b"})[0] == 0
    assert hits_of(llm, {"prompt_token_ids": PROMPT})[0] == 0  # unsalted is a tenant of its own
    assert hits_of(llm, {"prompt_token_ids": PROMPT})[0] == 32


def test_salt_must_be_a_non_empty_string(llm):
    with pytest.raises(ValueError, match="cache_salt=''"):
        llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": ""}], PARAMS)


def test_a_colliding_digest_never_reuses_other_tokens(llm, tiny_llama, monkeypatch):
    other = [t + 100 for t in PROMPT]
    reference = LLM(model=tiny_llama, block_size=8, num_gpu_blocks_override=128, enable_prefix_caching=False)
    expected = reference.generate([{"prompt_token_ids": other}], PARAMS)[0].outputs[0].token_ids
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, tokens: b"every block collides")
    hits_of(llm, {"prompt_token_ids": PROMPT})
    hits, tokens = hits_of(llm, {"prompt_token_ids": other})
    assert hits == 0 and tokens == expected
    assert hits_of(llm, {"prompt_token_ids": PROMPT})[0] == 8  # equal content still hits (first block)
    assert llm.llm_engine.block_manager.check_invariants() == []


def test_a_reused_parent_block_invalidates_its_cached_children(tiny_llama):
    """A child cached under parent block P stops matching once P is evicted and refilled."""
    llm = LLM(model=tiny_llama, block_size=8, num_gpu_blocks_override=12, enable_prefix_caching=True)
    hits_of(llm, {"prompt_token_ids": PROMPT})
    for i in range(4):  # churn the pool so the cached blocks are evicted and reused
        hits_of(llm, {"prompt_token_ids": [t + 50 + i for t in PROMPT]})
    hits, tokens = hits_of(llm, {"prompt_token_ids": PROMPT})
    reference = LLM(model=tiny_llama, block_size=8, num_gpu_blocks_override=64, enable_prefix_caching=False)
    assert tokens == reference.generate([{"prompt_token_ids": PROMPT}], PARAMS)[0].outputs[0].token_ids
    assert llm.llm_engine.block_manager.check_invariants() == []
