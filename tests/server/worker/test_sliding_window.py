"""Mistral with a sliding window, prompts several windows long: greedy tokens against transformers."""

from __future__ import annotations

import pytest
import torch
from engine_factories import HFReference, assert_greedy_matches, save_tiny_mistral

from pagedllm.server import LLM, SamplingParams
from tests.support import assert_all_blocks_free

WINDOW = 24
MAX_TOKENS = 40  # decoding crosses several blocks and windows too
TIGHT_GROUP_BLOCKS = 32  # blocks of 8 in which groups of 3 samples of many_prompts get swapped out


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


@pytest.mark.parametrize(
    "backend,block_size",
    # NOTE: Triton runs through its interpreter on CPU (minutes): one block size
    [("numba", 8), ("numba", 16), ("torch", 8), ("torch", 16), ("triton", 8)],
)
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


@pytest.fixture(scope="module")
def many_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (60, 97, 131, 200, 75, 150, 88, 180)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches(mistral_dir, reference, many_prompts, mode):
    """A cache of 30 blocks of 8 (the longest sequence fits alone): freed blocks make
    preemption rare, these prompts still meet it."""
    llm, outputs = run_greedy(
        mistral_dir,
        many_prompts,
        block_size=8,
        num_gpu_blocks_override=30,
        preemption_mode=mode,
        max_num_batched_tokens=16,
    )
    assert llm.llm_engine.stats().num_preemptions > 0
    check(reference, many_prompts, [reference.greedy(p, MAX_TOKENS) for p in many_prompts], outputs)
    assert_all_blocks_free(llm)


def test_beam_search_matches_transformers(mistral_dir, reference, prompts):
    """Beams fork from one another (shared blocks, copy-on-write) and drop the blocks behind the window."""
    eos, pad = 257, 258
    llm = LLM(model=mistral_dir, block_size=8, num_gpu_blocks_override=128)
    params = SamplingParams(
        use_beam_search=True, best_of=3, n=2, temperature=0, max_tokens=MAX_TOKENS, early_stopping="never"
    )
    for prompt in prompts[:2]:
        ours = [o.token_ids for o in llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs]
        ids = torch.tensor([prompt])
        theirs = reference.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=3,
            num_return_sequences=2,
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            early_stopping="never",
            eos_token_id=eos,
            pad_token_id=pad,
        )[:, len(prompt) :].tolist()
        for a, b in zip(ours, theirs):
            assert b[: len(a)] == a and all(t == pad for t in b[len(a) :]), f"ours {ours} vs transformers {theirs}"
    assert llm.llm_engine.stats().num_window_frees > 0
    assert_all_blocks_free(llm)


def test_swapped_groups_keep_their_outputs(mistral_dir, many_prompts):
    """Seeded parallel samples (n=3) in a tight cache, swapped out and in with blocks freed
    behind the window: the same tokens as with room to spare."""
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in many_prompts]
    roomy = LLM(model=mistral_dir, block_size=8, num_gpu_blocks_override=512).generate(batch, params)
    tight = LLM(model=mistral_dir, block_size=8, num_gpu_blocks_override=TIGHT_GROUP_BLOCKS, preemption_mode="swap")
    squeezed = tight.generate(batch, params)
    assert tight.llm_engine.stats().num_preemptions > 0
    assert [[o.token_ids for o in r.outputs] for r in squeezed] == [[o.token_ids for o in r.outputs] for r in roomy]
    assert_all_blocks_free(tight)


def test_a_long_sequence_holds_only_its_window(mistral_dir, reference):
    """Decoding 200 tokens past a 200-token prompt, the sequence holds at most
    ceil(window / block_size) + 1 blocks; the stats show the rest freed."""
    prompt = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = LLM(model=mistral_dir, block_size=8, enable_prefix_caching=False).llm_engine
    engine.add_request(
        "long", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    )
    bound = -(-WINDOW // 8) + 1
    most, outputs = 0, []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        stats = engine.stats()
        if stats.num_running:
            most = max(most, stats.blocks_used)
            assert stats.blocks_used <= bound
            assert stats.num_free_gpu_blocks == stats.num_gpu_blocks - stats.blocks_used
    assert most == bound
    tokens = outputs[0].outputs[0].token_ids
    assert len(tokens) == 200
    assert_greedy_matches(reference, prompt, tokens, reference.greedy(prompt, 200))
    stats = engine.stats()
    # after the last step (which computed position 398) a next query would sit at 399 and see
    # 376..399: every block wholly before position 376 had been freed
    assert stats.num_window_frees == (399 - WINDOW + 1) // 8
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
