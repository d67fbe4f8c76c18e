"""Beam search and parallel sampling: tokens against transformers, block sharing, preemption."""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_factories import HFReference, make_prompts

from pagedllm.server import LLM, SamplingParams
from pagedllm.server.core.block_manager import BlockManager
from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.core.sequence_updates import NewSeq, SequenceUpdater
from pagedllm.server.engine.beam_search import BeamSearch, BeamState
from pagedllm.server.engine.output_processor import OutputProcessor
from pagedllm.server.worker.sampling_batch import Tokens

PAD = 258
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return HFReference(tiny_llama)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(3, min_len=3, max_len=60, seed=11)


def hf_beams(ref, prompt, width, n, length_penalty, early_stopping, eos):
    ids = torch.tensor([prompt])
    out = ref.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=width,
        num_return_sequences=n,
        do_sample=False,
        max_new_tokens=MAX_TOKENS,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=eos,
        pad_token_id=PAD,
    )
    return [[t for t in row[len(prompt) :].tolist()] for row in out]


def same_beam(ours: list[int], theirs: list[int]) -> bool:
    return theirs[: len(ours)] == ours and all(t == PAD for t in theirs[len(ours) :])


@pytest.mark.parametrize(
    "width,n,length_penalty,early_stopping",
    [
        (3, 3, 1.0, False),
        (4, 2, 0.5, True),
        (2, 1, 1.0, "never"),
        (4, 4, 2.0, "never"),
    ],
)
def test_beam_search_matches_transformers(tiny_llama, reference, prompts, width, n, length_penalty, early_stopping):
    llm = LLM(model=tiny_llama, block_size=8, num_gpu_blocks_override=256)
    engine = llm.llm_engine
    # A frequent token as EOS, so beams finish at different lengths.
    eos = [
        o.outputs[0].token_ids
        for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        )
    ]
    for prompt, greedy in zip(prompts, eos):
        engine.output_processor.eos_token_ids = (greedy[1],)
        params = SamplingParams(
            use_beam_search=True,
            best_of=width,
            n=n,
            temperature=0,
            max_tokens=MAX_TOKENS,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )
        ours = llm.generate([{"prompt_token_ids": prompt}], params)[0]
        theirs = hf_beams(reference, prompt, width, n, length_penalty, early_stopping, greedy[1])
        got = [o.token_ids for o in ours.outputs]
        assert len(got) == n
        for a, b in zip(got, theirs):
            assert same_beam(a, b), f"ours {got} vs transformers {theirs}"
    stats = engine.stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks


def test_beam_search_api_and_blocks_shared(tiny_llama, prompts):
    llm = LLM(model=tiny_llama, block_size=8, num_gpu_blocks_override=256)
    engine = llm.llm_engine
    engine.add_request(
        "b",
        {"prompt_token_ids": prompts[2]},
        SamplingParams(use_beam_search=True, best_of=4, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    savings = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats()
        if stats.blocks_unshared:
            savings.append(stats.sharing_saving)
    assert max(savings) > 0.5  # four beams over a shared 60-token prompt
    outs = llm.beam_search([{"prompt_token_ids": prompts[0]}], beam_width=3, max_tokens=5, ignore_eos=True)
    assert len(outs[0].outputs) == 3 and all(len(o.token_ids) == 5 for o in outs[0].outputs)
    scores = [o.cumulative_logprob / len(o.token_ids) for o in outs[0].outputs]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("kind", ["beam", "parallel"])
def test_swap_preemption_of_groups_keeps_outputs(tiny_llama, prompts, kind):
    if kind == "beam":
        params = SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0, max_tokens=12, ignore_eos=True)
    else:
        params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    free = LLM(model=tiny_llama, block_size=4, num_gpu_blocks_override=512).generate(batch, params)
    tight = LLM(model=tiny_llama, block_size=4, num_gpu_blocks_override=40, preemption_mode="swap")
    squeezed = tight.generate(batch, params)
    stats = tight.llm_engine.stats()
    assert stats.num_preemptions > 0
    assert [[o.token_ids for o in r.outputs] for r in squeezed] == [[o.token_ids for o in r.outputs] for r in free]
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks and stats.num_free_cpu_blocks == stats.num_cpu_blocks


def peak_blocks(llm, prompt, params) -> int:
    engine = llm.llm_engine
    engine.add_request("p", prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats()
        peak = max(peak, stats.num_gpu_blocks - stats.num_free_gpu_blocks)
    return peak


@pytest.mark.parametrize("prompt_len", [37, 40])
def test_parallel_sampling_shares_prompt_blocks(tiny_llama, prompt_len):
    block_size, n = 8, 4
    prompt = {"prompt_token_ids": list(range(1, prompt_len + 1))}
    llm = LLM(model=tiny_llama, block_size=block_size, num_gpu_blocks_override=256, enable_prefix_caching=False)
    single = peak_blocks(llm, prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True))
    before = llm.llm_engine.stats().num_copy_on_writes
    many = peak_blocks(llm, prompt, SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=20, ignore_eos=True))
    assert many < n * single
    # Prompt blocks are shared; only a partially filled last prompt block is copied, once per extra sample.
    expected_copies = (n - 1) if prompt_len % block_size else 0
    assert llm.llm_engine.stats().num_copy_on_writes - before == expected_copies
    full_prompt_blocks = prompt_len // block_size
    assert many == full_prompt_blocks + n * (-(-(prompt_len + 20 - 1) // block_size) - full_prompt_blocks)


def test_beam_search_decides_and_the_scheduler_forks_and_drops():
    bm = BlockManager(4, 16, 0)
    params = SamplingParams(use_beam_search=True, best_of=2, n=2, temperature=0, max_tokens=10)
    beams = [Sequence(i, [1, 2, 3], [5], SequenceStatus.RUNNING, 4, cumulative_logprob=-1.0 - i) for i in range(2)]
    group = SequenceGroup("r", list(beams), params)
    for beam in beams:
        bm.allocate(beam)
    state, ids = BeamState(), itertools.count(100)
    candidates = [Tokens([7, 8], [-0.1, -0.2]), Tokens([9, 3], [-0.1, -3.0])]  # 3 (EOS) ranks too low to end
    update = BeamSearch(OutputProcessor(None, (3,), 100), ids.__next__).decide(group, state, beams, candidates)
    assert [b.output_token_ids for b in beams] == [[5], [5]] and group.seqs == beams  # decided, nothing changed
    assert update.new_seqs == (NewSeq(0, 100),) and update.drops == (1,) and update.seqs == (0, 100)
    assert [(u.seq_id, u.token_ids) for u in update.updates] == [(100, (8,)), (0, (7,))] and update.hypotheses == ()
    SequenceUpdater(bm).apply_group(group, update)
    assert [(s.seq_id, s.output_token_ids) for s in group.seqs] == [(0, [5, 7]), (100, [5, 8])]
    assert sorted(bm.tables) == [0, 100] and bm.check_invariants() == []
