"""The persistent batch against the list-based builder, over many steps of a real scheduler.

A seeded random driver runs a :class:`Scheduler` and :class:`BlockManager` through
arrivals, finishes, aborts, recompute and swap preemption (a tiny cache), parallel
sampling forks, beam search (forks, dropped beams, reordered beams), copy-on-write,
prefix caching, chunked prefill and prompt logprobs. Every step, every tensor of
``prepare_batched_inputs`` must equal that of ``prepare_inputs``.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from pagedllm.server.config import SchedulerConfig
from pagedllm.server.core.block_manager import BlockManager
from pagedllm.server.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.engine.input_batch import InputBatch
from pagedllm.server.engine.step_inputs import StepInputs, prepare_batched_inputs, prepare_inputs
from pagedllm.server.sampling_params import SamplingParams
from pagedllm.server.worker.model_step import ARRAY_FIELDS


def assert_same_step(ours: StepInputs, expected: StepInputs) -> None:
    for name in ("input_ids", "positions", "sample_index", "prompt_index"):
        a, b = getattr(ours, name), getattr(expected, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), (name, a, b)
    assert ours.meta.num_decode_tokens == expected.meta.num_decode_tokens
    for name in ARRAY_FIELDS:
        a, b = getattr(ours.meta, name), getattr(expected.meta, name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), (name, a, b)
    assert [(r.group, r.seq, r.prompt_positions) for r in ours.sample_rows] == [
        (r.group, r.seq, r.prompt_positions) for r in expected.sample_rows
    ]
    assert [(r.group, r.seq, r.draft_token_ids) for r in ours.spec_rows] == [
        (r.group, r.seq, r.draft_token_ids) for r in expected.spec_rows
    ]
    assert [(r.group, r.seq, r.prompt_positions) for r in ours.prompt_rows] == [
        (r.group, r.seq, r.prompt_positions) for r in expected.prompt_rows
    ]


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
        self.batch = InputBatch(self.sched.config.max_num_seqs, -(-max_len // block_size), block_size)
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

    def step(self) -> SchedulerOutput:
        if self.speculate:
            self._propose()
        out = self.sched.schedule()
        self.events.update(
            preempted=len(out.preempted),
            swap_in=bool(out.blocks_to_swap_in),
            swap_out=bool(out.blocks_to_swap_out),
            copy=bool(out.blocks_to_copy),
        )
        expected = prepare_inputs(out, self.bm.tables, self.bm.block_size)
        ours = prepare_batched_inputs(out, self.batch, self.bm.tables, self.bm.table_versions)
        assert_same_step(ours, expected)
        self.events["decodes"] += ours.meta.num_decode_tokens
        self.events["prefills"] += ours.meta.num_prefills
        self.sched.mark_computed(out)
        self._verified(expected.spec_rows)
        for row in expected.sample_rows:
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
def test_persistent_batch_equals_the_list_builder(seed, num_blocks, caching, config, speculate):
    driver = Driver(seed, num_blocks, block_size=4, caching=caching, max_len=48, **config)
    driver.speculate = speculate
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


def test_rows_follow_the_step_order_and_only_new_blocks_are_written():
    batch = InputBatch(max_num_seqs=4, max_blocks_per_seq=4, block_size=2)
    seqs = [Sequence(i, list(range(3 + i))) for i in range(3)]
    for seq in seqs:
        seq.num_computed_tokens = len(seq) - 1
    tables = {0: [5, 6], 1: [7, 8], 2: [9, 10, 11]}
    versions = {0: 1, 1: 2, 2: 3}
    rows = batch.prepare(seqs, tables, versions)
    assert rows.block_tables.tolist() == [[5, 6, 0], [7, 8, 0], [9, 10, 11]]
    assert rows.slot_mapping.tolist() == [6 * 2 + 0, 8 * 2 + 1, 11 * 2 + 0]
    assert rows.context_lens.tolist() == [3, 4, 5]
    # Sequence 1 finished; 0 grew a block; 2 was rebuilt (copy-on-write: a new version).
    seqs[0].append_token(1, 0.0, None)
    seqs[0].num_computed_tokens += 1
    tables[0].append(12)
    tables[2] = [9, 10, 13]
    versions[2] = 4
    rows = batch.prepare([seqs[2], seqs[0]], tables, versions)
    assert batch.seq_ids == [2, 0]
    assert rows.block_tables.tolist() == [[9, 10, 13], [5, 6, 12]]
    assert rows.positions.tolist() == [4, 3] and rows.input_ids.tolist() == [4, 1]
    # A table longer than the tensor grows it.
    tables[0] += [14, 15, 16]
    rows = batch.prepare([seqs[0]], tables, versions)
    assert rows.block_tables.tolist() == [[5, 6, 12, 14, 15, 16]]
