"""The step contract: what crosses from the scheduler to the workers, keyed by sequence id.

A worker keeps each sequence it was told about (its tokens and block table) across steps,
so a step sends a sequence in full once and then only what changed::

    step k    new:    seq 7  tokens [p0 .. p9]  blocks [4 9 2]  computed 0
    step k+1  cached: seq 7  tokens +[t10]      blocks +[]      computed 10
    step k+5  cached: seq 7  tokens +[t14]      blocks +[11]    computed 14
    step k+6  cached: seq 7  tokens +[t15]      blocks =[4 9 3 11] (copy-on-write: replaced)
    step k+9  finished: 7                                        (the worker drops it)

Every tensor-parallel rank gets the same :class:`SchedulerOutput` (the driver's alone carries
the sampling batch), applies the same diffs and so keeps the same batch; the worker turns it
into the step's arrays (:mod:`pagedllm.server.worker.input_batch`).

NOTE: frozen and made of tuples: the object a rank receives is the object the scheduler
made, never changed after; it pickles by value. No torch, no numpy here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.server.lora_request import LoRARequest

if TYPE_CHECKING:
    from pagedllm.server.worker.sampling_batch import SamplingBatch

Pairs = tuple[tuple[int, int], ...]

PLACEHOLDER_TOKEN_ID = -1
"""A token the scheduler scheduled before it was known (``async_scheduling``): the one its sequence
samples in the step before. It appears only as a sequence's last token; the worker fills it in
from the ids it sampled in that step, on its device."""


@dataclass(frozen=True, slots=True)
class NewSeqData:
    """A sequence the workers do not know (yet, or again after it was dropped): all of it."""

    seq_id: int
    token_ids: tuple[int, ...]  # every token so far, prompt then output
    block_ids: tuple[int, ...]  # its whole block table
    num_computed_tokens: int
    lora_slot: int = 0  # its adapter's slot (0: the base model)


@dataclass(frozen=True, slots=True)
class CachedSeqs:
    """The scheduled sequences the workers know, column by column (one entry per sequence).

    ``new_block_ids[i]`` is appended to the worker's table, unless ``replaced[i]`` says it is the
    whole new table (copy-on-write, swap in, window release: see ``BlockManager.table_versions``).
    """

    seq_ids: tuple[int, ...] = ()
    new_token_ids: tuple[tuple[int, ...], ...] = ()  # tokens since the last step that sent this sequence
    new_block_ids: tuple[tuple[int, ...], ...] = ()
    replaced: tuple[bool, ...] = ()
    num_computed_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    """One model step, keyed by sequence id; the only thing the workers get for a step.

    The step computes ``num_scheduled_tokens[i]`` tokens of sequence ``scheduled_seq_ids[i]``
    from its ``num_computed_tokens`` on, sequences in step order: ``num_decodes`` single-token
    decodes, then ``num_verifies`` sequences verifying proposals (their newest token then
    ``spec_token_ids``), then prefill chunks.
    """

    new_seqs: tuple[NewSeqData, ...] = ()
    cached_seqs: CachedSeqs = CachedSeqs()
    scheduled_seq_ids: tuple[int, ...] = ()
    num_scheduled_tokens: tuple[int, ...] = ()
    num_decodes: int = 0
    num_verifies: int = 0
    spec_token_ids: tuple[tuple[int, ...], ...] = ()
    """The proposals of each verifying sequence, in step order."""
    sample_seq_ids: tuple[int, ...] = ()
    """Sequences (decodes or prefills) whose last scheduled token samples, in step order; every
    verifying sequence's rows follow theirs."""
    prompt_logprobs: Pairs = ()
    """(seq id, n): the first n tokens of its chunk score the prompt token after each."""
    pooled: tuple[tuple[int, int, int], ...] = ()
    """(seq id, first, n): the hidden states of tokens [first, first + n) of its chunk are summed."""
    finished_seq_ids: tuple[int, ...] = ()
    """Sequences the workers knew that are gone since the last step (finished, aborted, recomputed)."""
    reset: bool = False
    """Forget every sequence first (the step before failed: what the workers hold is unknown)."""
    swap_out: Pairs = ()
    swap_in: Pairs = ()
    copies: Pairs = ()
    lora_adapters: tuple[tuple[int, LoRARequest], ...] = ()
    """(slot, adapter) of every adapter the step uses (empty: the base model alone)."""
    sampling: SamplingBatch | None = None
    """The driver's :class:`~pagedllm.server.worker.sampling_batch.SamplingBatch` (None elsewhere)."""

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def for_other_ranks(self) -> SchedulerOutput:
        """The step without its sampling (only the driver samples)."""
        return dataclasses.replace(self, sampling=None)

    def with_sampling(self, sampling: SamplingBatch | None) -> SchedulerOutput:
        return dataclasses.replace(self, sampling=sampling)
