"""What the speculative-decoding tests share: the copying prompts, an engine with a small
block size, and a run that checks after every step that no proposal or its slots outlive it."""

from __future__ import annotations

import torch
from engine_factories import HFReference, assert_greedy_matches, make_prompts

from pagedllm.server import SamplingParams
from pagedllm.server.config import EngineConfig
from pagedllm.server.engine.llm_engine import LLMEngine

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def copying_prompts() -> list[list[int]]:
    """Prompts whose continuations repeat what came before (loops, repeated phrases) and random ones."""
    g = torch.Generator().manual_seed(11)
    phrases = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 5, 8, 13)]
    copying = [p * 4 for p in phrases] + [phrases[1] + phrases[2] + phrases[1] + phrases[2][:3]]
    return copying + make_prompts(4, min_len=2, max_len=50, seed=12)


def engine(model: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model=model, block_size=4, **{"num_gpu_blocks_override": 256, **kwargs}))


def run(e: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    """Step to the end, checking after every step that no proposal or its slots outlive the step."""
    for i, prompt in enumerate(prompts):
        e.add_request(str(i), {"prompt_token_ids": prompt}, params[i] if isinstance(params, list) else params)
    done: dict[str, list[int]] = {}
    bm = e.block_manager
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        assert bm.check_invariants() == []
        for group in e.scheduler.running:
            for seq in group.seqs:
                assert not seq.spec_token_ids
                if seq.seq_id in bm.tables:
                    assert len(bm.tables[seq.seq_id]) <= -(-len(seq) // bm.block_size), "slots of rejected proposals"
    assert bm.gpu.num_free == bm.gpu.num_blocks and bm.cpu.num_free == bm.cpu.num_blocks and not bm.tables
    return [done[str(i)] for i in range(len(prompts))]


def assert_same_greedy(reference: HFReference, prompts, ours, expected) -> None:
    """Every request's tokens equal the expected ones, or differ first at a near-tie of the reference."""
    for prompt, a, b in zip(prompts, ours, expected):
        assert_greedy_matches(reference, prompt, a, b)
