"""A finished model step's tokens into decisions for the scheduler: prompt logprobs, sampled
tokens, beams, verified proposals, embeddings.

NOTE: all of this is per-request work, so a failure in it fails that request alone: it
is recorded in ``failed`` (request id -> reason), gets no update, and the scheduler aborts
it after the step (``Scheduler.update_from_output``), freeing its blocks, while every other
request goes on. The worker's
sampler isolates its own failures the same way (``SamplerOutput.errors``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.core.sequence_updates import GroupUpdate, NewSeq, SeqUpdate, StepUpdates
from pagedllm.server.engine.beam_search import BeamSearch, BeamState
from pagedllm.server.engine.output_processor import OutputProcessor
from pagedllm.server.engine.sampling_rows import logprob_dicts
from pagedllm.server.engine.spec_decode.spec_decoder import SpecDecoder
from pagedllm.server.engine.step_inputs import PoolRow, StepResult
from pagedllm.server.engine.structured_output import StructuredOutputs
from pagedllm.server.outputs import Logprob
from pagedllm.server.worker.sampling_batch import SamplerOutput, Tokens

logger = logging.getLogger("pagedllm.engine")


@dataclass
class RequestState:
    """What the engine keeps per request beside the scheduler's :class:`SequenceGroup`."""

    group: SequenceGroup
    beam: BeamState | None = None
    """Hypotheses so far, for beam search requests."""
    grammar: Any = None
    """The compiled grammar of a structured-output request."""
    matchers: dict[int, Any] = field(default_factory=dict)
    """seq_id -> the grammar matcher following that sequence's tokens."""
    pooled: np.ndarray | None = None
    """An embedding request's sum of hidden states over ``num_pooled`` positions so far (float32)."""
    num_pooled: int = 0
    embedding: np.ndarray | None = None
    """An embedding request's result, once its whole prompt is pooled."""

    def matcher(self, seq: Sequence, structured: StructuredOutputs) -> Any:
        return self.matcher_of(seq.seq_id, structured)

    def matcher_of(self, seq_id: int, structured: StructuredOutputs) -> Any:
        """The grammar matcher following sequence ``seq_id``'s tokens (made on first use)."""
        if seq_id not in self.matchers:
            self.matchers[seq_id] = structured.matcher(self.grammar)
        return self.matchers[seq_id]


class StepResults:
    """Decides what one step's tokens do to the requests in it; the scheduler applies the decisions.

    NOTE: sequences are read here, never changed (the scheduler's :class:`SequenceUpdater`
    is their one writer); the engine's own per-request state (grammar matchers, pooled sums,
    beam scores, proposal statistics) is kept up to date here.
    """

    def __init__(
        self,
        output_processor: OutputProcessor,
        beam_search: BeamSearch,
        requests: dict[str, RequestState],
        new_seq_id: Callable[[], int],
        structured: StructuredOutputs,
        spec: SpecDecoder | None = None,
    ) -> None:
        self.spec = spec
        """Speculative decoding's settling of verified proposals (None: off)."""
        self.structured = structured
        self.output_processor = output_processor
        self.beam_search = beam_search
        self.requests = requests
        self.new_seq_id = new_seq_id
        """Ids for the sequences parallel samples fork."""

    def decide(self, result: StepResult, failed: dict[str, str]) -> StepUpdates:
        """Prompt logprobs, sampled tokens, verified proposals and finished embeddings, as updates for
        :meth:`Scheduler.update_from_output`; requests that fail go to ``failed`` instead."""
        sampled = result.sampled
        updates: list[GroupUpdate] = []
        first_token: tuple[str, ...] = ()
        if sampled is not None:
            for request_id, reason in sampled.errors.items():
                failed.setdefault(request_id, reason)
            self._prompt_logprobs(result, sampled, failed, updates)
            first_token = tuple(row.group.request_id for row in result.inputs.sample_rows)
            self._samples(result, sampled, failed, updates)
            self._verified(result, sampled, failed, updates)
        self._pool(result, failed, updates)
        return StepUpdates(tuple(updates), first_token, time.monotonic())

    def _fail(self, failed: dict[str, str], group: SequenceGroup, stage: str, error: Exception) -> None:
        logger.error("request %s failed in %s: %r", group.request_id, stage, error, exc_info=error)
        failed.setdefault(group.request_id, f"{stage} failed: {error!r}")

    def _samples(
        self, result: StepResult, sampled: SamplerOutput, failed: dict[str, str], updates: list[GroupUpdate]
    ) -> None:
        rows = result.inputs.sample_rows
        beam_rows: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            group = row.group
            tokens = sampled.rows[i]
            if group.request_id in failed or tokens is None:
                continue
            if group.sampling_params.use_beam_search:
                beam_rows.setdefault(group.request_id, []).append(i)
                continue
            try:
                updates.append(self._sample(group, row.seq, tokens))
            except Exception as exc:
                self._fail(failed, group, "output processing", exc)
        for request_id, indices in beam_rows.items():
            if request_id in failed:
                continue
            state = self.requests[request_id]
            assert state.beam is not None
            try:
                candidates = [tokens for i in indices if (tokens := sampled.rows[i]) is not None]
                beams = [rows[i].seq for i in indices]
                updates.append(self.beam_search.decide(state.group, state.beam, beams, candidates))
            except Exception as exc:
                self._fail(failed, state.group, "beam search", exc)

    def _verified(
        self, result: StepResult, sampled: SamplerOutput, failed: dict[str, str], updates: list[GroupUpdate]
    ) -> None:
        """Sequences that verified proposals: accepted tokens appended, the cache settled."""
        for row, tokens in zip(result.inputs.spec_rows, sampled.verified):
            if row.group.request_id in failed or tokens is None:
                continue
            assert self.spec is not None
            try:
                updates.append(self.spec.decide(row, tokens.token_ids, tokens.logprobs, logprob_dicts(tokens)))
            except Exception as exc:
                self._fail(failed, row.group, "output processing", exc)

    def _sample(self, group: SequenceGroup, seq: Sequence, tokens: Tokens) -> GroupUpdate:
        """The sampled token appended; the group's first sample forks the other ``best_of - 1``."""
        tops = logprob_dicts(tokens) if tokens.top is not None else None
        if len(tokens.token_ids) == 1:
            return GroupUpdate(group.request_id, updates=(self._token(group, seq, seq.seq_id, tokens, tops, 0),))
        forks = [NewSeq(seq.seq_id, self.new_seq_id()) for _ in range(1, len(tokens.token_ids))]
        seq_updates = [self._token(group, seq, fork.seq_id, tokens, tops, i + 1) for i, fork in enumerate(forks)]
        seq_updates.append(self._token(group, seq, seq.seq_id, tokens, tops, 0))
        order = tuple(s.seq_id for s in group.seqs) + tuple(fork.seq_id for fork in forks)
        return GroupUpdate(group.request_id, new_seqs=tuple(forks), updates=tuple(seq_updates), seqs=order)

    def _token(
        self,
        group: SequenceGroup,
        seq: Sequence,
        seq_id: int,
        tokens: Tokens,
        tops: list[dict[int, Logprob] | None] | None,
        i: int,
    ) -> SeqUpdate:
        """Token ``i`` appended to ``seq`` (or to its fork ``seq_id``, a copy of it as it is now)."""
        token = tokens.token_ids[i]
        state = self.requests[group.request_id]
        if state.grammar is not None and not state.matcher_of(seq_id, self.structured).accept_token(token):
            raise RuntimeError(f"the grammar refused token {token} that its own mask allowed")
        logprob = tokens.logprobs[i] if tokens.logprobs is not None else None
        top = tops[i] if tops is not None else None
        update = self.output_processor.decide(
            seq, (token,), (logprob,), (top,) if top is not None else None, group.sampling_params
        )
        if seq_id != seq.seq_id:
            update = replace(update, seq_id=seq_id)
        if (
            state.grammar is not None
            and update.finish is None
            and state.matcher_of(seq_id, self.structured).is_terminated()
        ):
            update = replace(update, finish=SequenceStatus.FINISHED_STOPPED)  # NOTE: the grammar is complete
        return update

    def _prompt_logprobs(
        self, result: StepResult, sampled: SamplerOutput, failed: dict[str, str], updates: list[GroupUpdate]
    ) -> None:
        for row, tokens in zip(result.inputs.prompt_rows, sampled.prompts):
            if tokens is None or row.group.request_id in failed:
                continue
            try:
                updates.append(GroupUpdate(row.group.request_id, prompt_logprobs=tuple(logprob_dicts(tokens))))
            except Exception as exc:
                self._fail(failed, row.group, "prompt logprobs", exc)

    def _pool(self, result: StepResult, failed: dict[str, str], updates: list[GroupUpdate]) -> None:
        rows = result.inputs.pool_rows
        if not rows:
            return
        assert result.pooled is not None
        for row, pooled in zip(rows, result.pooled):
            if row.group.request_id in failed:
                continue
            try:
                if self._add_pooled(self.requests[row.group.request_id], row, pooled):
                    done = SeqUpdate(row.seq.seq_id, finish=SequenceStatus.FINISHED_STOPPED)
                    updates.append(GroupUpdate(row.group.request_id, updates=(done,)))
            except Exception as exc:
                self._fail(failed, row.group, "pooling", exc)

    @staticmethod
    def _add_pooled(state: RequestState, row: PoolRow, pooled: np.ndarray) -> bool:
        """Add a chunk's hidden-state sum; True: the chunk ends the prompt, so the embedding is ready
        and the request finishes."""
        # NOTE: a prompt preempted by recomputation starts again from position 0: so does its sum.
        if row.start == 0 or state.pooled is None:
            state.pooled, state.num_pooled = np.zeros_like(pooled), 0
        state.pooled += pooled
        state.num_pooled += row.num
        if not row.completes_prompt:
            return False
        params = row.group.pooling_params
        assert params is not None
        embedding = state.pooled / state.num_pooled
        if params.normalize:
            embedding = embedding / max(float(np.linalg.norm(embedding)), 1e-12)  # as torch's normalize
        state.embedding = embedding
        return True
