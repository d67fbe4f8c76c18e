"""The engine's side of speculative decoding: proposals before a step, acceptance after it.

Before each step :meth:`SpecDecoder.propose` picks up to k proposed tokens for each eligible
decoding sequence (the scheduler sets them as ``Sequence.spec_token_ids``); the scheduler gives such a sequence one
chunk of ``1 + k`` tokens, with cache slots, or drops its proposals when there is no room.
The worker verifies the ``1 + k`` logits rows of each on its device
(:mod:`~pagedllm.server.worker.spec_verify`) and returns the emitted tokens; after the step
:meth:`SpecDecoder.decide` says to append the accepted proposals and one more token, to count
the accepted proposals as computed (their K/V was written by the step, in the right context)
and to free the blocks that held only rejected ones; the scheduler does so::

    before:  tokens ... t | proposals d0 d1 d2      table: [.. B7 B9]   (B9 for d1, d2)
    verify:  target accepts d0, emits x             tokens ... t d0 x, computed ... t d0
    after:   table [.. B7]  (B9 freed: x lands in B7; stale slots past it are overwritten)

Adaptive, per sequence: proposals are as long as the last ones proved useful (the accepted
ones plus one; doubled, up to k, when all were accepted), since every verified token costs
compute; and a sequence whose proposals keep being rejected outright pauses proposing for
1, 2, 4 ... up to ``MAX_PAUSE`` steps, so a workload with nothing to copy costs nearly
nothing. One accepted proposal resumes proposing at every step.

With a draft model (``draft_model``) the proposals need the cache slots the scheduler
gives the chunk, so :meth:`propose` only says how many (placeholders), and
:meth:`fill_drafts`, between scheduling and the step, runs the draft that many times over
the sequences that kept their slots, and the scheduler puts its greedy tokens in place.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pagedllm.server.config import SpeculativeConfig
from pagedllm.server.core.block_manager import BlockManager
from pagedllm.server.core.scheduler import ScheduledStep
from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.core.sequence_updates import GroupUpdate
from pagedllm.server.engine.output_processor import OutputProcessor
from pagedllm.server.engine.spec_decode.draft_model import DraftModel, DraftState
from pagedllm.server.engine.spec_decode.ngram_proposer import NgramIndex
from pagedllm.server.engine.step_inputs import SpecRow
from pagedllm.server.outputs import Logprob

MAX_PAUSE = 64
"""The most steps a sequence whose proposals keep failing goes without proposing."""


@dataclass
class SpecDecodeStats:
    """Counters since start, named as vLLM's ``spec_decode_*`` metrics."""

    num_drafts: int = 0
    """Proposals verified (one per sequence per step that had any)."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    """[k] how often the proposal at each position was accepted."""

    def snapshot(self) -> SpecDecodeStats:
        """A copy that later steps do not change."""
        return SpecDecodeStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_pos)
        )

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step yields on average: the accepted proposals plus the one it samples."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class _SeqState:
    index: NgramIndex | None  # None with a draft model
    length: int  # the most tokens to propose next
    failures: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # steps left without proposals
    draft: DraftState = field(default_factory=DraftState)


class SpecDecoder:
    """Proposes with n-grams, verifies by rejection sampling, settles the cache; owns the counters."""

    def __init__(
        self,
        config: SpeculativeConfig,
        output_processor: OutputProcessor,
        block_manager: BlockManager,
        requests: Mapping[str, Any],
        draft: DraftModel | None = None,
    ) -> None:
        self.config = config
        self.draft = draft
        """The draft model (``draft_model``), None for n-grams."""
        self.output_processor = output_processor
        self.block_manager = block_manager
        self.requests = requests
        """request id -> RequestState (the engine's; read for the grammar)."""
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._states: weakref.WeakKeyDictionary[Sequence, _SeqState] = weakref.WeakKeyDictionary()

    def describe(self) -> str:
        c = self.config
        if self.draft is not None:
            return (
                f"draft model {self.draft.path}, {c.num_speculative_tokens} tokens, paused per request while rejected"
            )
        return (
            f"{c.method}, {c.num_speculative_tokens} tokens, n-grams of {c.prompt_lookup_min}-{c.prompt_lookup_max},"
            " paused per request while rejected"
        )

    # -- before the step ----------------------------------------------------------------
    def propose(self, running: list[SequenceGroup], max_model_len: int) -> dict[int, list[int]]:
        """The proposals (seq id -> tokens) of every running sequence that may speculate this step,
        for :meth:`Scheduler.set_proposals`."""
        proposals: dict[int, list[int]] = {}
        for group in running:
            if len(group.seqs) != 1 or not self._eligible(group):
                continue
            seq = group.seqs[0]
            if seq.status is not SequenceStatus.RUNNING or len(seq.token_ids) - seq.num_computed_tokens != 1:
                continue
            state = self._state(seq)
            if state.pause:
                state.pause -= 1
                continue
            room = min(state.length, self._room(group, seq, max_model_len))
            if state.index is not None:
                tokens = state.index.propose(seq.token_ids, room)
            else:  # NOTE: placeholders, filled by fill_drafts once slots exist
                tokens = [0] * max(room, 0)
            if tokens:
                proposals[seq.seq_id] = tokens
        return proposals

    def _eligible(self, group: SequenceGroup) -> bool:
        params = group.sampling_params
        state = self.requests.get(group.request_id)
        return (
            params.best_of == 1
            and not params.use_beam_search
            and group.pooling_params is None
            and (state is None or state.grammar is None)
        )

    def _room(self, group: SequenceGroup, seq: Sequence, max_model_len: int) -> int:
        """Proposals worth verifying: k, less what would run past max_tokens or max_model_len."""
        room = self.config.num_speculative_tokens
        max_tokens = group.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - len(seq.output_token_ids) - 1)
        return min(room, max_model_len - len(seq.token_ids) - 1)

    def _state(self, seq: Sequence) -> _SeqState:
        state = self._states.get(seq)
        if state is None:
            low, high = self.config.prompt_lookup_min, self.config.prompt_lookup_max
            assert low is not None and high is not None  # NOTE: SpeculativeConfig fills both in
            index = NgramIndex(low, high) if self.draft is None else None
            state = self._states[seq] = _SeqState(index, self.config.num_speculative_tokens)
        return state

    def fill_drafts(self, out: ScheduledStep) -> dict[int, list[int]]:
        """The draft model's tokens (seq id -> tokens) to replace the scheduled sequences' placeholders.

        The first pass brings each sequence's draft cache up to date (usually its newest
        token or two; all of it the first time, or after its blocks moved) and proposes one
        token; each further pass feeds the last proposal back, for the sequences that want more.
        """
        if self.draft is None:
            return {}
        bs = self.draft.block_size
        seqs = [seq for item in out.scheduled for seq in item.group.seqs if seq.spec_token_ids]
        if not seqs:
            return {}
        tables = {seq.seq_id: self.block_manager.tables[seq.seq_id] for seq in seqs}
        chunks = []
        for seq in seqs:
            table = tables[seq.seq_id]
            start = self._state(seq).draft.valid_prefix(table, bs)
            chunks.append((seq.token_ids[start:], start, table))
        drafts = {seq.seq_id: [token] for seq, token in zip(seqs, self.draft.next_tokens(chunks))}
        for step in range(1, max(len(seq.spec_token_ids) for seq in seqs)):
            wanting = [seq for seq in seqs if len(seq.spec_token_ids) > step]
            chunks = [([drafts[s.seq_id][-1]], len(s.token_ids) + step - 1, tables[s.seq_id]) for s in wanting]
            for seq, token in zip(wanting, self.draft.next_tokens(chunks)):
                drafts[seq.seq_id].append(token)
        for seq in seqs:
            # NOTE: the K/V of the proposals but the last is written now; decide() counts what stays valid
            self._state(seq).draft = DraftState(len(seq.token_ids), tuple(tables[seq.seq_id]))
        return drafts

    # -- after the step (the worker verified the proposals: spec_verify) --------------
    def decide(
        self,
        row: SpecRow,
        emitted: list[int],
        logprobs: list[float] | None = None,
        top: list[dict[int, Logprob] | None] | None = None,
    ) -> GroupUpdate:
        """Append ``emitted`` (until the sequence finishes), count the accepted proposals as computed,
        free the slots of the rejected ones: the update that does it. ``logprobs`` and ``top``: per
        emitted token, the model's own (None: not asked for)."""
        seq, params, drafts = row.seq, row.group.sampling_params, row.draft_token_ids
        accepted = len(emitted) - 1
        if self.draft is not None:  # NOTE: the draft wrote K/V for every proposal but the last
            self._state(seq).draft.computed += min(accepted, len(drafts) - 1)
        update = self.output_processor.decide(seq, emitted, logprobs, top, params)
        self._record(seq, len(drafts), accepted)
        # NOTE: the K/V of an appended accepted proposal was computed after accepted tokens only.
        num_accepted = min(len(update.token_ids), accepted)
        return GroupUpdate(row.group.request_id, updates=(replace(update, verified=True, num_accepted=num_accepted),))

    def _record(self, seq: Sequence, num_drafts: int, accepted: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += accepted
        for i in range(accepted):
            stats.accepted_per_pos[i] += 1
        state = self._state(seq)
        k = self.config.num_speculative_tokens
        state.length = min(k, 2 * num_drafts) if accepted == num_drafts else accepted + 1
        if accepted:
            state.failures = 0
            return
        state.failures += 1
        state.pause = min(1 << (state.failures - 1), MAX_PAUSE)
