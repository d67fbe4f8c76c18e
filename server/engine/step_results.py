"""A finished model step's tokens into requests: prompt logprobs, sampled tokens, beams, verified
proposals, embeddings.

NOTE: all of this is per-request work, so a failure in it fails that request alone: it
is recorded in ``failed`` (request id -> reason) and the engine aborts those requests
after the step, freeing their blocks, while every other request goes on. The worker's
sampler isolates its own failures the same way (``SamplerOutput.errors``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.server.core.scheduler import Scheduler
from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.engine.beam_search import BeamSearch, BeamState
from pagedllm.server.engine.output_processor import OutputProcessor
from pagedllm.server.engine.sampling_rows import logprob_dicts
from pagedllm.server.engine.spec_decode.spec_decoder import SpecDecoder
from pagedllm.server.engine.step_inputs import PoolRow, SampleRow, StepResult
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
        if seq.seq_id not in self.matchers:
            self.matchers[seq.seq_id] = structured.matcher(self.grammar)
        return self.matchers[seq.seq_id]


class StepResults:
    """Applies one step's tokens to the requests in it."""

    def __init__(
        self,
        output_processor: OutputProcessor,
        beam_search: BeamSearch,
        scheduler: Scheduler,
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
        self.scheduler = scheduler
        """Forks parallel samples (children share the prompt's blocks)."""
        self.requests = requests
        self.new_seq_id = new_seq_id

    def apply(self, result: StepResult, failed: dict[str, str]) -> None:
        """Record prompt logprobs, append sampled tokens and pool embeddings; failures go to ``failed``."""
        sampled = result.sampled
        if sampled is not None:
            for request_id, reason in sampled.errors.items():
                failed.setdefault(request_id, reason)
            self._record_prompt_logprobs(result, sampled, failed)
            self._samples(result, sampled, failed)
            self._verified(result, sampled, failed)
        self._pool(result, failed)

    def _fail(self, failed: dict[str, str], group: SequenceGroup, stage: str, error: Exception) -> None:
        logger.error("request %s failed in %s: %r", group.request_id, stage, error, exc_info=error)
        failed.setdefault(group.request_id, f"{stage} failed: {error!r}")

    def _samples(self, result: StepResult, sampled: SamplerOutput, failed: dict[str, str]) -> None:
        rows = result.inputs.sample_rows
        now = time.monotonic()
        beam_rows: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            group = row.group
            if group.first_token_time is None:
                group.first_token_time = now
            tokens = sampled.rows[i]
            if group.request_id in failed or tokens is None:
                continue
            if group.sampling_params.use_beam_search:
                beam_rows.setdefault(group.request_id, []).append(i)
                continue
            try:
                self._append(group, row.seq, tokens)
            except Exception as exc:
                self._fail(failed, group, "output processing", exc)
        for request_id, indices in beam_rows.items():
            if request_id in failed:
                continue
            state = self.requests[request_id]
            assert state.beam is not None
            try:
                candidates = [tokens for i in indices if (tokens := sampled.rows[i]) is not None]
                self.beam_search.step(state.group, state.beam, [rows[i].seq for i in indices], candidates)
            except Exception as exc:
                self._fail(failed, state.group, "beam search", exc)

    def _verified(self, result: StepResult, sampled: SamplerOutput, failed: dict[str, str]) -> None:
        """Sequences that verified proposals: accepted tokens appended, the cache settled."""
        for row, tokens in zip(result.inputs.spec_rows, sampled.verified):
            if row.group.request_id in failed or tokens is None:
                continue
            assert self.spec is not None
            try:
                self.spec.apply(row, tokens.token_ids, tokens.logprobs, logprob_dicts(tokens))
            except Exception as exc:
                self._fail(failed, row.group, "output processing", exc)

    def _append(self, group: SequenceGroup, seq: Sequence, tokens: Tokens) -> None:
        """Append the sampled token; the group's first sample forks the other ``best_of - 1``."""
        tops = logprob_dicts(tokens) if tokens.top is not None else None
        for i in range(1, len(tokens.token_ids)):
            child = self.scheduler.fork(seq, self.new_seq_id())  # NOTE: shares the parent's blocks
            group.seqs.append(child)
            self._append_token(group, child, tokens, tops, i)
        self._append_token(group, seq, tokens, tops, 0)

    def _append_token(
        self, group: SequenceGroup, seq: Sequence, tokens: Tokens, tops: list[dict[int, Logprob] | None] | None, i: int
    ) -> None:
        token = tokens.token_ids[i]
        state = self.requests[group.request_id]
        if state.grammar is not None:
            matcher = state.matcher(seq, self.structured)
            if not matcher.accept_token(token):
                raise RuntimeError(f"the grammar refused token {token} that its own mask allowed")
        logprob = tokens.logprobs[i] if tokens.logprobs is not None else None
        top = tops[i] if tops is not None else None
        self.output_processor.append_token(seq, token, logprob, top, group.sampling_params)
        if (
            state.grammar is not None
            and state.matcher(seq, self.structured).is_terminated()
            and not seq.status.finished
        ):
            seq.status = SequenceStatus.FINISHED_STOPPED  # NOTE: the grammar is complete: nothing may follow

    def _record_prompt_logprobs(self, result: StepResult, sampled: SamplerOutput, failed: dict[str, str]) -> None:
        for row, tokens in zip(result.inputs.prompt_rows, sampled.prompts):
            if tokens is None or row.group.request_id in failed:
                continue
            try:
                self._append_prompt_logprobs(row, tokens)
            except Exception as exc:
                self._fail(failed, row.group, "prompt logprobs", exc)

    @staticmethod
    def _append_prompt_logprobs(row: SampleRow, tokens: Tokens) -> None:
        group = row.group
        if not group.prompt_logprobs:
            group.prompt_logprobs = [None]  # the first prompt token has no logprob
        group.prompt_logprobs.extend(logprob_dicts(tokens))

    def _pool(self, result: StepResult, failed: dict[str, str]) -> None:
        rows = result.inputs.pool_rows
        if not rows:
            return
        assert result.pooled is not None
        for row, pooled in zip(rows, result.pooled):
            if row.group.request_id in failed:
                continue
            try:
                self._add_pooled(self.requests[row.group.request_id], row, pooled)
            except Exception as exc:
                self._fail(failed, row.group, "pooling", exc)

    @staticmethod
    def _add_pooled(state: RequestState, row: PoolRow, pooled: np.ndarray) -> None:
        """Add a chunk's hidden-state sum; the chunk ending the prompt finishes the request with its embedding."""
        # NOTE: a prompt preempted by recomputation starts again from position 0: so does its sum.
        if row.start == 0 or state.pooled is None:
            state.pooled, state.num_pooled = np.zeros_like(pooled), 0
        state.pooled += pooled
        state.num_pooled += row.num
        if not row.completes_prompt:
            return
        params = row.group.pooling_params
        assert params is not None
        embedding = state.pooled / state.num_pooled
        if params.normalize:
            embedding = embedding / max(float(np.linalg.norm(embedding)), 1e-12)  # as torch's normalize
        state.embedding = embedding
        row.seq.status = SequenceStatus.FINISHED_STOPPED
