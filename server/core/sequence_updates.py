"""What a step does to requests and sequences, and the one place it is done.

Output processing, beam search and speculative decoding *decide* (they read sequences
and return the small frozen records below); :class:`SequenceUpdater`, owned by the
scheduler, *applies*. It is the only code outside :mod:`~pagedllm.server.core.sequence`
that changes a sequence or a group: tokens and their logprobs and text, stop verdicts,
accepted proposals and ``num_computed_tokens``, proposals, forks and drops (with the
block manager doing the block side), finished beam hypotheses::

    worker tokens ─► StepResults / BeamSearch / SpecDecoder ─► GroupUpdate ... (frozen)
                                                                   │
    Scheduler.update_from_output(out, updates) ─► SequenceUpdater ─┘─► sequences, groups, blocks

Records name sequences by id; a step's sequences are looked up among its scheduled
groups. A request whose update fails is reported, never half applied further.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.server.core.block_manager import BlockManager
from pagedllm.server.core.sequence import Logprobs, Sequence, SequenceGroup, SequenceStatus, StopReason

if TYPE_CHECKING:
    from pagedllm.server.core.scheduler import ScheduledStep

logger = logging.getLogger("pagedllm.engine")


@dataclass(frozen=True, slots=True)
class SeqUpdate:
    """New tokens for one sequence (with their logprobs and text) and its stop verdict."""

    seq_id: int
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float | None, ...] = ()
    """Per new token: its own log-probability (None: not asked for); empty: none at all."""
    top_logprobs: tuple[Logprobs | None, ...] = ()
    """Per new token: the top alternatives to record (None: not asked for); empty: none at all."""
    output_text: str | None = None
    """The whole output text afterwards (None: unchanged, e.g. without a tokenizer)."""
    offsets: tuple[int, int] | None = None
    """The incremental detokenizer's (prefix, read) offsets afterwards (None: unchanged)."""
    finish: SequenceStatus | None = None
    """The finished status the sequence ends in (None: it goes on)."""
    stop_reason: StopReason = None
    verified: bool = False
    """The sequence's proposals were verified this step: they are cleared and the cache is settled."""
    num_accepted: int = 0
    """Verified proposals counted as computed (their K/V was written in the right context)."""


@dataclass(frozen=True, slots=True)
class NewSeq:
    """A copy of ``parent_id`` as ``seq_id``, taken before this step's tokens are appended."""

    parent_id: int
    seq_id: int
    shares_blocks: bool = True
    """True: a running fork that shares every block of its parent; False: a block-less
    finished beam hypothesis, kept only as an output."""


@dataclass(frozen=True, slots=True)
class GroupUpdate:
    """Everything one step does to one request, applied in field order."""

    request_id: str
    prompt_logprobs: tuple[Logprobs | None, ...] | None = None
    """Prompt positions' logprobs to record (None: none; the first adds None for the first position)."""
    new_seqs: tuple[NewSeq, ...] = ()
    updates: tuple[SeqUpdate, ...] = ()
    drops: tuple[int, ...] = ()
    """Sequences that stop running here: their blocks lose a reference (shared ones stay)."""
    hypotheses: tuple[int, ...] | None = None
    """The beam hypotheses kept, best first (None: unchanged)."""
    seqs: tuple[int, ...] | None = None
    """The group's sequences afterwards, in order (None: unchanged)."""


@dataclass(frozen=True, slots=True)
class StepUpdates:
    """One step's decisions, for :meth:`Scheduler.update_from_output`."""

    groups: tuple[GroupUpdate, ...] = ()
    first_token: tuple[str, ...] = ()
    """Requests that sampled this step (their first token time is stamped if unset)."""
    time: float = 0.0
    """When the step's tokens arrived."""


class SequenceUpdater:
    """Applies decisions to sequences and groups; the block manager does the block side."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager

    # -- before the step ----------------------------------------------------------------
    def set_proposals(self, groups: Iterable[SequenceGroup], proposals: dict[int, list[int]]) -> None:
        """Give sequences (by id, among ``groups``) the tokens the coming step verifies."""
        if not proposals:
            return
        for group in groups:
            for seq in group.seqs:
                tokens = proposals.get(seq.seq_id)
                if tokens is not None:
                    seq.spec_token_ids = tokens

    # -- one step ahead (async scheduling, see lookahead.py) ----------------------------
    def advance(self, out: ScheduledStep) -> None:
        """Count every chunk of ``out`` (in flight) as computed, as processing it will; finished groups aside.

        NOTE: only the count: the blocks it completes are cached when the step is processed
        (:meth:`mark_computed` with ``advanced``), after its K/V is written.
        """
        for item in out.scheduled:
            if item.group.is_finished():
                continue
            for seq in item.group.seqs:
                chunk = item.chunks.get(seq.seq_id)
                if chunk:
                    seq.num_computed_tokens += min(chunk, len(seq.token_ids) - seq.num_computed_tokens)

    def add_placeholders(self, seqs: Iterable[Sequence], token_id: int) -> None:
        for seq in seqs:
            seq.append_placeholder(token_id)

    def drop_placeholders(self, seqs: Iterable[Sequence]) -> None:
        """Before the step that samples their tokens is applied: the placeholders go."""
        for seq in seqs:
            seq.drop_placeholder()

    # -- after the step -----------------------------------------------------------------
    def mark_computed(self, out: ScheduledStep, advanced: bool = False) -> None:
        """Advance every scheduled sequence by its chunk (unless ``advanced``: done) and cache its full blocks."""
        for item in out.scheduled:
            for seq in item.group.seqs:
                chunk = item.chunks.get(seq.seq_id)
                if chunk:
                    # NOTE: a chunk with proposals computes one real token; the accepted proposals
                    # are counted when the step's verdicts are applied (SeqUpdate.num_accepted).
                    if not advanced:
                        seq.num_computed_tokens += min(chunk, len(seq.token_ids) - seq.num_computed_tokens)
                    self.block_manager.mark_computed(seq)

    def apply(self, groups: dict[str, SequenceGroup], updates: StepUpdates, failed: dict[str, str]) -> None:
        """Apply ``updates`` to ``groups`` (request id -> group); a request that fails goes to ``failed``."""
        for request_id in updates.first_token:
            group = groups.get(request_id)
            if group is not None and group.first_token_time is None:
                group.first_token_time = updates.time
        for update in updates.groups:
            if update.request_id in failed:
                continue
            group = groups[update.request_id]
            try:
                self.apply_group(group, update)
            except Exception as exc:
                logger.error("request %s failed in its update: %r", group.request_id, exc, exc_info=exc)
                failed.setdefault(group.request_id, f"output processing failed: {exc!r}")

    def apply_group(self, group: SequenceGroup, update: GroupUpdate) -> None:
        """Apply one request's update, in its fields' order; sequences are named by id among the
        group's sequences, its hypotheses and the update's new sequences."""
        if update.prompt_logprobs is not None:
            if not group.prompt_logprobs:
                group.prompt_logprobs = [None]  # the first prompt token has no logprob
            group.prompt_logprobs.extend(update.prompt_logprobs)
        only = group.seqs[0] if len(group.seqs) == 1 else None
        if only is not None and not group.hypotheses and not update.new_seqs and len(update.updates) == 1:
            # NOTE: the usual decode: one sequence, one update (an unknown id raises KeyError, as below)
            seq_update = update.updates[0]
            if seq_update.seq_id != only.seq_id:
                raise KeyError(seq_update.seq_id)
            self._apply_seq(only, seq_update)
            self._finish_group(group, update, {only.seq_id: only})
            return
        seqs = {seq.seq_id: seq for seq in group.seqs}
        for hyp in group.hypotheses:
            seqs[hyp.seq_id] = hyp
        for new in update.new_seqs:
            parent = seqs[new.parent_id]
            child = seqs[new.seq_id] = parent.fork(new.seq_id)
            if new.shares_blocks:
                self.block_manager.fork(parent, child)  # NOTE: copied on write when a shared last block grows
        for seq_update in update.updates:
            self._apply_seq(seqs[seq_update.seq_id], seq_update)
        self._finish_group(group, update, seqs)

    def _finish_group(self, group: SequenceGroup, update: GroupUpdate, seqs: dict[int, Sequence]) -> None:
        """The update's fields after its sequences' tokens: drops, hypotheses, the new order."""
        if not update.drops and update.hypotheses is None and update.seqs is None:
            return
        for seq_id in update.drops:
            self.block_manager.free(seqs[seq_id])
        if update.hypotheses is not None:
            group.hypotheses = [seqs[seq_id] for seq_id in update.hypotheses]
        if update.seqs is not None:
            group.seqs = [seqs[seq_id] for seq_id in update.seqs]

    def _apply_seq(self, seq: Sequence, update: SeqUpdate) -> None:
        none = (None,) * len(update.token_ids)
        logprobs, tops = update.logprobs or none, update.top_logprobs or none
        assert len(logprobs) == len(tops) == len(none), "one logprob and one top entry per new token"
        for token, logprob, top in zip(update.token_ids, logprobs, tops):
            seq.append_token(token, logprob, top)
        if update.output_text is not None:
            seq.output_text = update.output_text
        if update.offsets is not None:
            seq.prefix_offset, seq.read_offset = update.offsets
        if update.finish is not None:
            seq.status = update.finish
            if update.stop_reason is not None:
                seq.stop_reason = update.stop_reason
        if update.verified:
            seq.spec_token_ids = []
            seq.num_computed_tokens += update.num_accepted
            if seq.seq_id in self.block_manager.tables:
                self.block_manager.mark_computed(seq)
                self.block_manager.release_unused_slots(seq)
