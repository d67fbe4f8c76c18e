"""The worker's persistent batch against the list-based builder, over many steps of a real scheduler.

A seeded random driver runs a :class:`Scheduler` and :class:`BlockManager` through
arrivals, finishes, aborts, recompute and swap preemption (a tiny cache), parallel
sampling forks, beam search (forks, dropped beams, reordered beams), copy-on-write,
prefix caching, chunked prefill, prompt logprobs, proposals and failed steps. Every step
the scheduler's id-keyed output travels pickled (as to a tensor-parallel rank) to a worker
batch, whose arrays must equal those :func:`prepare_inputs` builds from the live sequences.
"""

from __future__ import annotations

import dataclasses
import pickle
import random
from collections import Counter

import numpy as np
import pytest

from pagedllm.server.config import SchedulerConfig
from pagedllm.server.core.block_manager import BlockManager
from pagedllm.server.core.scheduler import ScheduledStep, Scheduler
from pagedllm.server.core.scheduler_output import CachedSeqs, NewSeqData, SchedulerOutput
from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.engine.reference_inputs import prepare_inputs
from pagedllm.server.engine.step_inputs import StepBuilder
from pagedllm.server.sampling_params import SamplingParams
from pagedllm.server.worker import input_batch
from pagedllm.server.worker.input_batch import InputBatch
from pagedllm.server.worker.model_step import ARRAY_FIELDS, ModelStep


def assert_same_step(ours: ModelStep, expected: ModelStep) -> None:
    for name in ("input_ids", "positions", "sample_index", "prompt_index", "pool_index", "pool_lens"):
        a, b = getattr(ours, name), getattr(expected, name)
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and np.array_equal(a, b), (name, a, b)
    assert ours.meta.num_decode_tokens == expected.meta.num_decode_tokens
    for name in ARRAY_FIELDS:
        a, b = getattr(ours.meta, name), getattr(expected.meta, name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), (name, a, b)
    assert (ours.swap_out, ours.swap_in, ours.copies) == (expected.swap_out, expected.swap_in, expected.copies)


class Driver:
    """Plays the engine around a scheduler: samples, forks, beams, finishes and aborts at random."""

    def __init__(
        self, seed: int, num_blocks: int, block_size: int, caching: bool, max_len: int, window=None, **config
    ) -> None:
        self.rng = random.Random(seed)
        self.bm = BlockManager(
            block_size, num_blocks, num_blocks, enable_prefix_caching=caching, watermark=0.0, sliding_window=window
        )
        self.sched = Scheduler(SchedulerConfig(**config), self.bm)
        self.builder = StepBuilder(self.sched.worker_view)
        self.batch = InputBatch(self.sched.config.max_num_seqs, max_len, block_size)
        self.fail_rate = 0.0
        self.max_len = max_len
        self.next_seq = 0
        self.next_request = 0
        self.events: Counter[str] = Counter()
        self.speculate = False

    def _seq_id(self) -> int:
        self.next_seq += 1
        return self.next_seq

    def add_request(self) -> None:
        rng = self.rng
        kind = rng.choice(["single", "single", "parallel", "beam", "logprobs"])
        params = {
            "single": SamplingParams(),
            "parallel": SamplingParams(n=rng.randint(2, 3), temperature=1.0),
            "beam": SamplingParams(n=2, best_of=rng.randint(2, 3), use_beam_search=True, temperature=0.0),
            "logprobs": SamplingParams(prompt_logprobs=1),
        }[kind]
        shared = [1, 2, 3, 4, 5, 6, 7, 8, 9][: rng.randint(0, 9)]  # a common prefix for the prefix cache
        prompt = shared + [rng.randrange(100) for _ in range(rng.randint(1, self.max_len // 2))]
        group = SequenceGroup(str(self.next_request), [Sequence(self._seq_id(), prompt)], params)
        group.arrival_time = float(self.next_request)
        self.next_request += 1
        self.sched.add(group)

    def _propose(self) -> None:
        """Random proposals for lone decoding sequences (speculative decoding), as the engine makes them."""
        for group in self.sched.running:
            seq = group.seqs[0]
            if len(group.seqs) == 1 and len(seq) - seq.num_computed_tokens == 1 and self.rng.random() < 0.5:
                seq.spec_token_ids = [self.rng.randrange(100) for _ in range(self.rng.randint(1, 4))]

    def _verified(self, rows) -> None:
        """Accept a random number of each row's proposals and settle, as SpecDecoder.apply does."""
        for row in rows:
            seq, drafts = row.seq, row.draft_token_ids
            accepted = self.rng.randint(0, len(drafts))
            for token in drafts[:accepted] + [self.rng.randrange(100)]:
                seq.append_token(token, 0.0, None)
            seq.spec_token_ids = []
            seq.num_computed_tokens += accepted
            self.bm.mark_computed(seq)
            self.bm.release_unused_slots(seq)
            self.events["verified"] += 1
            if len(seq) >= self.max_len:
                seq.status = SequenceStatus.FINISHED_STOPPED

    def step(self) -> ScheduledStep:
        if self.speculate:
            self._propose()
        out = self.sched.schedule()
        self.events.update(
            preempted=len(out.preempted),
            swap_in=bool(out.blocks_to_swap_in),
            swap_out=bool(out.blocks_to_swap_out),
            copy=bool(out.blocks_to_copy),
        )
        inputs, plan = self.builder.build(out)
        plan = pickle.loads(pickle.dumps(plan))  # NOTE: what a tensor-parallel rank gets
        assert isinstance(plan, SchedulerOutput)
        if self.rng.random() < self.fail_rate:
            self._failed(out, plan)
            return out
        expected = prepare_inputs(out, self.bm.tables, self.bm.block_size)
        ours = self.batch.step(plan)
        assert_same_step(ours, expected)
        self.events["decodes"] += ours.meta.num_decode_tokens
        self.events["prefills"] += ours.meta.num_prefills
        self.events["new"] += len(plan.new_seqs)
        self.events["reset"] += plan.reset
        self.sched.mark_computed(out)
        self._verified(inputs.spec_rows)
        for row in inputs.sample_rows:
            if row.seq.status is SequenceStatus.RUNNING and row.seq in row.group.seqs:
                self._sampled(row.group, row.seq)
        for item in out.scheduled:
            if item.group.sampling_params.use_beam_search:
                self._beam_step(item.group)
        self.sched.free_finished()
        if self.rng.random() < 0.03 and self.sched.running:
            self.events["abort"] += 1
            self.sched.abort([self.rng.choice(self.sched.running).request_id])
        return out

    def _failed(self, out: ScheduledStep, plan: SchedulerOutput) -> None:
        """A failed step, as the engine handles one: its requests end, the workers are reset."""
        self.events["failed"] += 1
        if self.rng.random() < 0.5:
            self.batch.apply(plan)  # NOTE: one rank applied the step before another failed
        self.sched.worker_view.forget_all()
        self.sched.abort([item.group.request_id for item in out.scheduled])
        self.sched.free_finished()

    def _sampled(self, group: SequenceGroup, seq: Sequence) -> None:
        params = group.sampling_params
        if params.best_of > 1 and not params.use_beam_search and not seq.output_token_ids:
            for _ in range(params.best_of - 1):  # the first sample forks the other samples
                child = seq.fork(self._seq_id())
                self.bm.fork(seq, child)
                group.seqs.append(child)
                child.append_token(self.rng.randrange(100), 0.0, None)
                self.events["fork"] += 1
        if not params.use_beam_search:
            seq.append_token(self.rng.randrange(100), 0.0, None)
            if len(seq) >= self.max_len or self.rng.random() < 0.05:
                seq.status = SequenceStatus.FINISHED_STOPPED

    def _beam_step(self, group: SequenceGroup) -> None:
        """Like beam search: drop a beam, fork another, append to all, reorder by score."""
        beams = list(group.running_seqs())  # NOTE: a copy; running_seqs() may return group.seqs itself
        if not beams or any(b.num_computed_tokens < len(b) for b in beams):
            return
        if len(beams[0]) >= self.max_len or self.rng.random() < 0.03:
            for beam in beams:
                beam.status = SequenceStatus.FINISHED_LENGTH
            return
        if len(beams) > 1 and self.rng.random() < 0.5:
            dropped = self.rng.choice(beams)
            self.bm.free(dropped)
            group.seqs.remove(dropped)
            beams.remove(dropped)
        while len(beams) < group.sampling_params.best_of:
            parent = self.rng.choice(beams)
            child = parent.fork(self._seq_id())
            self.bm.fork(parent, child)
            group.seqs.append(child)
            beams.append(child)
            self.events["beam_fork"] += 1
        for beam in beams:
            beam.append_token(self.rng.randrange(100), self.rng.random(), None)
        group.seqs.sort(key=lambda s: s.cumulative_logprob, reverse=True)


@pytest.mark.parametrize(
    "seed, num_blocks, caching, config",
    [
        (0, 24, False, dict(max_num_seqs=8, max_num_batched_tokens=32)),  # tiny cache: preemption, swapping
        (1, 40, True, dict(max_num_seqs=16, max_num_batched_tokens=48)),  # prefix caching
        (2, 200, True, dict(max_num_seqs=32, max_num_batched_tokens=64)),  # a large batch, few preemptions
        (3, 30, True, dict(max_num_seqs=8, max_num_batched_tokens=12, preemption_mode="recompute")),
        (4, 30, False, dict(max_num_seqs=8, max_num_batched_tokens=64, preemption_mode="swap")),
        # blocks freed behind a sliding window: the tables keep their length, the rows stay right
        (5, 40, True, dict(max_num_seqs=16, max_num_batched_tokens=48, window=6)),
        (6, 24, False, dict(max_num_seqs=8, max_num_batched_tokens=32, window=3)),
    ],
)
@pytest.mark.parametrize("speculate", [False, True])
def test_worker_batch_equals_the_list_builder(seed, num_blocks, caching, config, speculate, monkeypatch):
    if seed == 2:  # NOTE: rows start short and widen as sequences grow
        monkeypatch.setattr(input_batch, "INITIAL_TOKENS", 4)
    driver = Driver(seed, num_blocks, block_size=4, caching=caching, max_len=48, **config)
    driver.speculate = speculate
    driver.fail_rate = 0.01 if seed % 2 else 0.0
    for _ in range(400):
        if driver.rng.random() < 0.3 or not driver.sched.has_unfinished():
            for _ in range(driver.rng.randint(1, 3)):
                driver.add_request()
        driver.step()
    assert not driver.bm.check_invariants()
    events = driver.events
    assert events["decodes"] > 500 and events["prefills"] > 50, events
    assert events["fork"] and events["beam_fork"] and events["copy"], events
    if seed in (0, 4):
        assert events["swap_out"] and events["swap_in"], events
    if seed in (0, 3):
        assert events["preempted"], events
    if caching:
        assert driver.bm.prefix_cache_hits, events
    if "window" in config:
        assert driver.bm.num_window_frees > 100, driver.bm.num_window_frees
    assert bool(events["verified"]) is speculate, events
    assert bool(events["reset"]) is bool(driver.fail_rate), events
    assert events["new"] < events["decodes"] / 4, events  # NOTE: known sequences travel as diffs


def test_diffs_update_rows_in_place_and_freed_rows_are_reused():
    batch = InputBatch(max_num_seqs=2, max_model_len=8, block_size=2)
    first = SchedulerOutput(
        new_seqs=(NewSeqData(10, (1, 2, 3), (5, 6), 2), NewSeqData(11, (4, 5, 6, 7), (7, 8), 3)),
        scheduled_seq_ids=(10, 11),
        num_scheduled_tokens=(1, 1),
        num_decodes=2,
        sample_seq_ids=(10, 11),
    )
    step = batch.step(first)
    assert step.input_ids.tolist() == [3, 7] and step.positions.tolist() == [2, 3]
    assert step.meta.slot_mapping.tolist() == [6 * 2 + 0, 8 * 2 + 1]
    assert step.meta.decode_block_tables.tolist() == [[5, 6], [7, 8]]
    # 10 gets a token and a block; 11 a token and a whole new (shorter) table: copy-on-write.
    second = SchedulerOutput(
        cached_seqs=CachedSeqs((11, 10), ((9,), (4,)), ((12,), (13,)), (True, False), (4, 3)),
        scheduled_seq_ids=(11, 10),
        num_scheduled_tokens=(1, 1),
        num_decodes=2,
        sample_seq_ids=(11, 10),
    )
    step = batch.step(second)
    assert step.input_ids.tolist() == [9, 4] and step.positions.tolist() == [4, 3]
    assert step.meta.decode_block_tables.tolist() == [[12, 0, 0], [5, 6, 13]]
    assert step.meta.decode_context_lens.tolist() == [5, 4]
    # 11 finished: its row goes to the next new sequence, its old table gone; the arrays grow past max_num_seqs.
    third = SchedulerOutput(
        new_seqs=(NewSeqData(12, (8,), (3,), 0), NewSeqData(13, (1, 1), (4,), 0)),
        cached_seqs=CachedSeqs((10,), ((),), ((),), (False,), (3,)),
        scheduled_seq_ids=(10, 12, 13),
        num_scheduled_tokens=(1, 1, 2),
        num_decodes=2,
        sample_seq_ids=(10, 12, 13),
        finished_seq_ids=(11,),
    )
    step = batch.step(third)
    assert 11 not in batch and len(batch) == 3
    assert step.meta.decode_block_tables.tolist() == [[5, 6, 13], [3, 0, 0]]
    assert step.meta.prefill_block_tables.tolist() == [[4]] and step.sample_index.tolist() == [0, 1, 3]
    assert batch.step(SchedulerOutput(reset=True)).input_ids.size == 0
    assert len(batch) == 0


def test_placeholders_point_at_the_previous_steps_sample_rows():
    """With lookahead, a placeholder token names the sample row of the step before that holds its id."""
    batch = InputBatch(4, 64, 4, lookahead=True)
    first = SchedulerOutput(
        new_seqs=(NewSeqData(7, (1, 2, 3), (0,), 0), NewSeqData(9, (4, 5), (1,), 0)),
        scheduled_seq_ids=(7, 9),
        num_scheduled_tokens=(3, 2),
        sample_seq_ids=(7, 9),
    )
    assert batch.step(first).placeholders is None
    placeholder = -1
    second = SchedulerOutput(
        cached_seqs=CachedSeqs((9, 7), ((placeholder,), (placeholder,)), ((), ()), (False, False), (2, 3)),
        scheduled_seq_ids=(9, 7),
        num_scheduled_tokens=(1, 1),
        num_decodes=2,
        sample_seq_ids=(9, 7),
    )
    step = batch.step(second)
    holes, rows = step.placeholders
    assert holes.tolist() == [0, 1] and rows.tolist() == [1, 0]  # seq 9 sampled in row 1, seq 7 in row 0
    assert step.input_ids.tolist() == [-1, -1]
    third = dataclasses.replace(second, cached_seqs=CachedSeqs((9,), ((placeholder,),), ((),), (False,), (3,)))
    third = dataclasses.replace(third, scheduled_seq_ids=(9,), num_scheduled_tokens=(1,), num_decodes=1)
    third = dataclasses.replace(third, sample_seq_ids=(9,))
    assert batch.step(third).placeholders[1].tolist() == [0]  # row 0 of the second step
    stray = dataclasses.replace(third, cached_seqs=CachedSeqs((7,), ((placeholder,),), ((),), (False,), (4,)))
    stray = dataclasses.replace(stray, scheduled_seq_ids=(7,))
    with pytest.raises(RuntimeError, match="did not sample"):
        batch.step(stray)  # seq 7 did not sample in the third step
