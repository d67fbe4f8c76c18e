"""One step's rows, on the engine side: which sequence each logits row (or pooled row) is, and the
id-keyed :class:`~pagedllm.server.core.scheduler_output.SchedulerOutput` the workers run.

    ScheduledStep (live groups) ─► StepBuilder.build ─┬► StepInputs (which sequence each row is)
                                                      └► SchedulerOutput (ids, diffs) ─► Executor.execute
                                                                                         └► StepOutputs (tokens)

The step's arrays (token ids, positions, slots, block tables, row indices) are built by each
worker from its persistent batch (:mod:`pagedllm.server.worker.input_batch`), in the order
the rows here follow: decodes, then verifications, then prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedllm.server.core.scheduler import ScheduledStep
from pagedllm.server.core.scheduler_output import SchedulerOutput
from pagedllm.server.core.sequence import Sequence, SequenceGroup
from pagedllm.server.core.worker_view import Entry, WorkerView, split_step
from pagedllm.server.worker.model_step import StepOutputs
from pagedllm.server.worker.sampling_batch import SamplerOutput


@dataclass(slots=True)
class SampleRow:
    """A row of the step's logits: the sequence it belongs to and what it is for."""

    group: SequenceGroup
    seq: Sequence
    prompt_positions: tuple[int, ...] = ()  # prompt logprob rows: token indices scored


@dataclass
class PoolRow:
    """A row of the step's pooled hidden states: the sum over ``num`` prompt positions from ``start``."""

    group: SequenceGroup
    seq: Sequence
    start: int
    num: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.num == len(self.seq)


@dataclass
class SpecRow:
    """A sequence verifying proposals: its logits are ``1 + len(draft_token_ids)`` rows, one per
    position from its newest token on (speculative decoding)."""

    group: SequenceGroup
    seq: Sequence
    draft_token_ids: list[int]


@dataclass
class StepInputs:
    """The step's rows, in the order of the worker's logits rows (sample rows, then verifications')."""

    sample_rows: list[SampleRow]  # sequences that reach their end and sample a token
    prompt_rows: list[SampleRow] = field(default_factory=list)  # sequences that want prompt logprobs for this chunk
    pool_rows: list[PoolRow] = field(default_factory=list)  # embedding requests' positions pooled this step
    spec_rows: list[SpecRow] = field(default_factory=list)
    """Sequences verifying proposals; their logits rows follow the sample rows'."""


@dataclass
class StepResult:
    """A step's rows and the worker's outputs for them (see :class:`StepOutputs`)."""

    inputs: StepInputs
    sampled: SamplerOutput | None
    """Tokens of the sample rows, verified proposals and prompt log-probabilities (None: no sampling)."""
    pooled: np.ndarray | None = None  # [len(inputs.pool_rows), hidden] float32 sums

    @classmethod
    def of(cls, inputs: StepInputs, outputs: StepOutputs) -> StepResult:
        return cls(inputs, outputs.sampled, outputs.pooled)


class StepBuilder:
    """Turns the scheduler's step into its rows and the workers' :class:`SchedulerOutput`."""

    def __init__(self, view: WorkerView) -> None:
        self.view = view
        """What the workers know of each sequence (the scheduler's): outputs carry only what changed."""

    def build(self, out: ScheduledStep) -> tuple[StepInputs, SchedulerOutput]:
        """The step's rows and what the workers run (its sampling batch is added by the engine)."""
        entries = split_step(out)
        decodes, verifies, prefills = entries
        if not verifies and not prefills:
            # NOTE: the usual step: every row samples its one token (its last) and none scores its
            # prompt or is pooled; one pass, left at the first row that does otherwise
            rows, ids = [], []
            for group, seq, _ in decodes:
                if (
                    seq.num_computed_tokens + 1 != len(seq.token_ids)
                    or group.sampling_params.prompt_logprobs is not None
                    or group.pooling_params is not None
                ):
                    break
                rows.append(SampleRow(group, seq))
                ids.append(seq.seq_id)
            else:
                return StepInputs(rows), self.view.emit(out, entries, ids)
        return step_rows(out, entries, self.view)


def step_rows(
    out: ScheduledStep, entries: tuple[list[Entry], list[Entry], list[Entry]], view: WorkerView
) -> tuple[StepInputs, SchedulerOutput]:
    """The rows whose logits (or hidden states) the step needs, entry by entry in token order."""
    inputs = StepInputs([])
    sample_ids: list[int] = []
    prompt: list[tuple[int, int]] = []
    pooled: list[tuple[int, int, int]] = []
    for group, seq, chunk in (*entries[0], *entries[1], *entries[2]):
        start = seq.num_computed_tokens
        if group.pooling_params is not None:
            row = _pool_row(group, seq, start, chunk)
            if row is not None:
                inputs.pool_rows.append(row)
                pooled.append((seq.seq_id, row.start - start, row.num))
        elif start + chunk == len(seq):
            inputs.sample_rows.append(SampleRow(group, seq))
            sample_ids.append(seq.seq_id)
        elif start + chunk > len(seq):
            inputs.spec_rows.append(SpecRow(group, seq, list(seq.spec_token_ids)))
        if group.sampling_params.prompt_logprobs is not None and start < len(seq.prompt_token_ids):
            scored = [p for p in range(start, start + chunk) if p + 1 < len(seq.prompt_token_ids)]
            inputs.prompt_rows.append(SampleRow(group, seq, tuple([p + 1 for p in scored])))
            prompt.append((seq.seq_id, len(scored)))
    return inputs, view.emit(out, entries, sample_ids, prompt, pooled)


def _pool_row(group: SequenceGroup, seq: Sequence, start: int, chunk: int) -> PoolRow | None:
    """The positions of this chunk an embedding request pools: all of them (mean), or the last prompt token."""
    assert group.pooling_params is not None
    if group.pooling_params.reads_every_position:
        return PoolRow(group, seq, start, chunk)
    return PoolRow(group, seq, len(seq) - 1, 1) if start + chunk == len(seq) else None
