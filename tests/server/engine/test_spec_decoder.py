"""The engine's speculative decoding bookkeeping: proposals, settling the cache, pausing, metrics."""

from __future__ import annotations

import httpx
import pytest
from api_factories import API_KEY, MODEL_NAME, live_server

from pagedllm.server import LLM
from pagedllm.server.config import ConfigError, SchedulerConfig, SpeculativeConfig
from pagedllm.server.core.block_manager import BlockManager
from pagedllm.server.core.scheduler import Scheduler
from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.engine.output_processor import OutputProcessor
from pagedllm.server.engine.spec_decode.spec_decoder import MAX_PAUSE, SpecDecoder
from pagedllm.server.engine.step_inputs import SpecRow
from pagedllm.server.sampling_params import SamplingParams

BLOCK = 4
LOOP = [7, 8, 9] * 4  # 12 tokens: three full blocks


def setup(num_blocks: int = 128, k: int = 4) -> tuple[SpecDecoder, Scheduler, SequenceGroup]:
    bm = BlockManager(BLOCK, num_blocks, 0, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    spec = SpecDecoder(
        SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3),
        OutputProcessor(None, (), 1000),
        bm,
        {},
    )
    group = SequenceGroup("r", [Sequence(0, list(LOOP))], SamplingParams(temperature=0, max_tokens=900))
    scheduler.add(group)
    scheduler.mark_computed(scheduler.schedule())  # the prompt, all of it computed
    group.seqs[0].append_token(7, 0.0, None)  # its first output token, not yet computed
    return spec, scheduler, group


def propose(spec: SpecDecoder, scheduler: Scheduler) -> None:
    """Proposals for the running sequences, set by the scheduler as the engine has it do."""
    scheduler.set_proposals(spec.propose(scheduler.running, 1000))


def settle(spec: SpecDecoder, scheduler: Scheduler, row: SpecRow, emitted: list[int]) -> None:
    """The verified proposals' update, applied by the scheduler as after a model step."""
    scheduler.updater.apply_group(row.group, spec.decide(row, emitted))


def verify_step(spec: SpecDecoder, scheduler: Scheduler, emitted: list[int]) -> SpecRow:
    """Schedule the proposals, then settle as the engine does after the model step."""
    out = scheduler.schedule()
    seq = out.scheduled[0].group.seqs[0]
    row = SpecRow(out.scheduled[0].group, seq, list(seq.spec_token_ids))
    scheduler.mark_computed(out)
    settle(spec, scheduler, row, emitted)
    return row


def test_proposals_take_slots_for_one_step_and_rejected_ones_give_them_back():
    spec, scheduler, group = setup()
    seq, bm = group.seqs[0], spec.block_manager
    propose(spec, scheduler)
    assert seq.spec_token_ids == [8, 9, 7, 8]  # the loop continued
    out = scheduler.schedule()
    assert out.scheduled[0].chunks == {seq.seq_id: 5} and out.num_batched_tokens == 5
    assert len(bm.tables[seq.seq_id]) == 5  # 13 tokens + 4 proposals = 17 slots
    free_before = bm.gpu.num_free
    row = SpecRow(group, seq, list(seq.spec_token_ids))
    scheduler.mark_computed(out)
    assert seq.num_computed_tokens == 13  # the real token only, until acceptance
    settle(spec, scheduler, row, [8, 5])  # one accepted, then the target's own token
    assert seq.output_token_ids == [7, 8, 5] and seq.num_computed_tokens == 14 and not seq.spec_token_ids
    assert len(bm.tables[seq.seq_id]) == 4 and bm.gpu.num_free == free_before + 1  # 15 tokens: 4 blocks
    assert bm.check_invariants() == []
    assert spec.stats.num_drafts == 1 and spec.stats.num_draft_tokens == 4 and spec.stats.num_accepted_tokens == 1
    assert spec.stats.accepted_per_pos == [1, 0, 0, 0] and spec.stats.mean_acceptance_length == 2.0


def test_the_prefix_cache_hashes_accepted_tokens_only():
    spec, scheduler, group = setup()
    seq, bm = group.seqs[0], spec.block_manager
    propose(spec, scheduler)  # 8 9 7 8: block 3 would be 7 8 9 7 with them
    verify_step(spec, scheduler, [5])  # rejected at once
    assert len(bm._hashes[seq.seq_id]) == 3  # the prompt's blocks; block 3 (7 5 ...) is not full
    propose(spec, scheduler)
    assert not seq.spec_token_ids  # paused after an outright rejection
    assert bm.check_invariants() == []


def test_a_request_whose_proposals_fail_pauses_longer_each_time():
    spec, scheduler, group = setup()
    seq = group.seqs[0]
    pauses = []
    for _ in range(9):
        steps = 0
        while True:
            propose(spec, scheduler)
            if seq.spec_token_ids:
                break
            steps += 1
            scheduler.mark_computed(scheduler.schedule())  # a plain decode step
            seq.append_token(7, 0.0, None)
        pauses.append(steps)
        verify_step(spec, scheduler, [3])  # never what was proposed
    assert pauses == [0, 1, 2, 4, 8, 16, 32, MAX_PAUSE, MAX_PAUSE]
    propose(spec, scheduler)
    assert spec.block_manager.check_invariants() == []


def test_an_accepted_proposal_resumes_proposing_every_step():
    spec, scheduler, group = setup()
    seq = group.seqs[0]
    propose(spec, scheduler)
    verify_step(spec, scheduler, [3])
    propose(spec, scheduler)
    assert not seq.spec_token_ids
    scheduler.mark_computed(scheduler.schedule())
    seq.append_token(8, 0.0, None)
    propose(spec, scheduler)
    drafts = list(seq.spec_token_ids)
    assert drafts
    verify_step(spec, scheduler, drafts[:2] + [7])  # two accepted; 7 was seen before: a match follows
    propose(spec, scheduler)
    assert seq.spec_token_ids


def test_without_room_proposals_are_dropped_never_a_preemption():
    spec, scheduler, group = setup(num_blocks=4)  # the 13 tokens hold all four blocks
    seq = group.seqs[0]
    propose(spec, scheduler)
    assert seq.spec_token_ids
    out = scheduler.schedule()
    assert out.scheduled[0].chunks == {seq.seq_id: 1} and not out.preempted and not seq.spec_token_ids


def test_proposals_stop_short_of_max_tokens_and_skip_what_cannot_verify():
    spec, scheduler, group = setup()
    seq = group.seqs[0]
    group.sampling_params = SamplingParams(temperature=0, max_tokens=3)
    propose(spec, scheduler)
    assert seq.spec_token_ids == [8]  # one output so far: two more to go, the last is the step's own
    for params in (SamplingParams(n=2, temperature=1.0), SamplingParams(best_of=2, temperature=1.0)):
        group.sampling_params = params
        seq.spec_token_ids = []
        propose(spec, scheduler)
        assert not seq.spec_token_ids
    seq.status = SequenceStatus.SWAPPED
    group.sampling_params = SamplingParams(temperature=0, max_tokens=100)
    propose(spec, scheduler)
    assert not seq.spec_token_ids


def test_metrics_and_banner_say_what_runs(tiny_llama):
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    with live_server(tiny_llama, speculative_config=config) as server:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {"model": MODEL_NAME, "prompt": "abcabcabcabcabc", "max_tokens": 24, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, headers=headers).status_code == 200
        metrics = httpx.get(f"{server.url}/metrics", headers=headers).text
        stats = server.stats().spec_decode
    assert stats is not None and stats.num_drafts > 0
    with LLM(model=tiny_llama, speculative_config=config) as llm:
        assert "speculative      ngram, 3 tokens, n-grams of 1-2" in llm.llm_engine.describe()
    for prefix in ("vllm", "pagedllm"):
        line = (
            f'{prefix}:spec_decode_num_draft_tokens_total{{model_name="{MODEL_NAME}"}} {float(stats.num_draft_tokens)}'
        )
        assert line in metrics
        assert f'{prefix}:spec_decode_num_accepted_tokens_total{{model_name="{MODEL_NAME}"}}' in metrics
        for position in range(3):
            assert (
                f'{prefix}:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{MODEL_NAME}",position="{position}"}}'
                in metrics
            )


def test_reservation_baselines_refuse_speculation(tiny_llama):
    with pytest.raises(ConfigError) as info:
        LLM(model=tiny_llama, kv_reservation="max", speculative_config={"method": "ngram"})
    assert info.value.field == "speculative_config" and "kv_reservation='max'" in str(info.value)


def test_proposals_shrink_to_what_was_accepted_and_grow_back():
    spec, scheduler, group = setup()
    seq = group.seqs[0]
    propose(spec, scheduler)
    drafts = list(seq.spec_token_ids)
    assert len(drafts) == 4
    verify_step(spec, scheduler, drafts[:1] + [9])  # one of four accepted (9 follows 8: the loop goes on)
    lengths = []
    for _ in range(3):
        propose(spec, scheduler)
        drafts = list(seq.spec_token_ids)
        lengths.append(len(drafts))
        verify_step(spec, scheduler, drafts + [LOOP[(len(seq) + len(drafts)) % 3]])  # all accepted
    assert lengths == [2, 4, 4]
