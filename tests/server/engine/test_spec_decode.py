"""Speculative decoding in the engine: the same greedy tokens as without it on every CPU backend
and at TP 2, seeded sampling unchanged, preemption and prefix caching intact, no slot leaked."""

from __future__ import annotations

import pytest
from engine_factories import HFReference
from spec_factories import GREEDY, NGRAM, assert_same_greedy, copying_prompts, engine, run

from pagedllm.server import SamplingParams
from pagedllm.server.core.block_manager import block_hash, salt_digest


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return copying_prompts()


@pytest.fixture(scope="module")
def reference(tiny_llama) -> HFReference:
    return HFReference(tiny_llama)


@pytest.fixture(scope="module")
def plain(tiny_llama, prompts) -> list[list[int]]:
    return run(engine(tiny_llama), prompts, GREEDY)


@pytest.mark.parametrize("backend", ["numba", "torch", "triton"])
def test_greedy_tokens_are_those_without_speculation(tiny_llama, prompts, plain, reference, backend):
    e = engine(tiny_llama, attention_backend=backend, speculative_config=NGRAM)
    picked = range(len(prompts)) if backend != "triton" else (0, 4)  # NOTE: the Triton interpreter is slow
    some = [prompts[i] for i in picked]
    num = GREEDY.max_tokens if backend != "triton" else 10
    ours = run(e, some, SamplingParams(temperature=0, max_tokens=num, ignore_eos=True))
    assert_same_greedy(reference, some, ours, [plain[i][:num] for i in picked])
    stats = e.stats().spec_decode
    assert stats is not None and stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens


@pytest.mark.timeout(600)
def test_greedy_tokens_at_two_ranks(tiny_llama, prompts, plain, reference):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        e = engine(tiny_llama, tensor_parallel_size=2, speculative_config=NGRAM)
        try:
            ours = run(e, prompts[:6], GREEDY)
            assert e.stats().spec_decode.num_accepted_tokens > 0
        finally:
            e.shutdown()
    assert_same_greedy(reference, prompts[:6], ours, plain[:6])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_tight_cache(tiny_llama, prompts, plain, reference, mode):
    e = engine(tiny_llama, num_gpu_blocks_override=40, preemption_mode=mode, speculative_config=NGRAM)
    ours = run(e, prompts, GREEDY)
    assert e.scheduler.num_preemptions > 0
    assert_same_greedy(reference, prompts, ours, plain)
    assert e.stats().spec_decode.num_accepted_tokens > 0


def test_prefix_cache_holds_only_accepted_tokens(tiny_llama, prompts, plain, reference):
    """Every cached block's key is that of a block of some request's final tokens: no rejected proposal
    was ever hashed; a second round reuses the cache and still gives the same tokens."""
    e = engine(tiny_llama, enable_prefix_caching=True, speculative_config=NGRAM)
    ours = run(e, prompts, GREEDY)
    again = run(e, prompts, GREEDY)
    assert again == ours and e.stats().prefix_cache_hits > 0
    valid = set()
    for prompt, out in zip(prompts, ours):
        tokens, parent = prompt + out, salt_digest(None)
        for i in range(len(tokens) // 4):
            parent = block_hash(parent, tokens[i * 4 : (i + 1) * 4])
            valid.add(parent)
    cached = set(e.block_manager.gpu._hash_to_block)
    assert cached and cached <= valid
    assert_same_greedy(reference, prompts, ours, plain)


def test_seeded_sampling_is_unchanged_by_speculation(tiny_llama, prompts):
    """n-gram proposals are one-hot drafts: acceptance uses one draw per emitted token, as sampling does."""
    params = [
        SamplingParams(temperature=0.3, top_p=0.9, seed=100 + i, max_tokens=24, ignore_eos=True)
        for i in range(len(prompts))
    ]
    base = run(engine(tiny_llama), prompts, params)
    e = engine(tiny_llama, speculative_config=NGRAM)
    spec = run(e, prompts, params)
    assert spec == base
    assert e.stats().spec_decode.num_accepted_tokens > 0
    assert run(engine(tiny_llama, speculative_config=NGRAM), prompts, params) == spec


def test_stop_rules_and_penalties_hold_within_accepted_tokens(tiny_llama, prompts, plain):
    """A stop token, max_tokens and penalties apply token by token among the accepted ones."""
    stop = plain[0][7]
    params = [
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop]),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3, min_tokens=4),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.5),
    ]
    some = prompts[:4]
    assert run(engine(tiny_llama, speculative_config=NGRAM), some, params) == run(engine(tiny_llama), some, params)
