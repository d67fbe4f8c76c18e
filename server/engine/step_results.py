"""A finished model step's logits into requests: prompt logprobs, sampled tokens, beams, embeddings.

NOTE: all of this is per-request work, so a failure in it fails that request alone: it
is recorded in ``failed`` (request id -> reason) and the engine aborts those requests
after the step, freeing their blocks, while every other request goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.server.core.scheduler import Scheduler
from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.engine.beam_search import BeamSearch, BeamState
from pagedllm.server.engine.faults import FaultInjector
from pagedllm.server.engine.output_processor import OutputProcessor
from pagedllm.server.engine.sampler import Sample, Sampler, SampleRequest, TokenCounts, top_logprobs
from pagedllm.server.engine.spec_decode.spec_decoder import SpecDecoder
from pagedllm.server.engine.step_inputs import PoolRow, SampleRow, StepResult
from pagedllm.server.engine.structured_output import StructuredOutputs

logger = logging.getLogger("pagedllm.engine")


@dataclass
class RequestState:
    """What the engine keeps per request beside the scheduler's :class:`SequenceGroup`."""

    group: SequenceGroup
    generator: torch.Generator | None = None
    """The request's own random generator when it has a seed."""
    beam: BeamState | None = None
    """Hypotheses so far, for beam search requests."""
    grammar: Any = None
    """The compiled grammar of a structured-output request."""
    matchers: dict[int, Any] = field(default_factory=dict)
    """seq_id -> the grammar matcher following that sequence's tokens."""
    pooled: torch.Tensor | None = None
    """An embedding request's sum of hidden states over ``num_pooled`` positions so far (float32)."""
    num_pooled: int = 0
    embedding: torch.Tensor | None = None
    """An embedding request's result, once its whole prompt is pooled."""
    token_counts: dict[int, TokenCounts] = field(default_factory=dict)
    """seq_id -> its tokens counted for the penalties, updated by each step's appends."""

    def matcher(self, seq: Sequence, structured: StructuredOutputs) -> Any:
        if seq.seq_id not in self.matchers:
            self.matchers[seq.seq_id] = structured.matcher(self.grammar)
        return self.matchers[seq.seq_id]


class StepResults:
    """Applies one step's logits to the requests in it."""

    def __init__(
        self,
        sampler: Sampler,
        output_processor: OutputProcessor,
        beam_search: BeamSearch,
        scheduler: Scheduler,
        requests: dict[str, RequestState],
        new_seq_id: Callable[[], int],
        structured: StructuredOutputs,
        faults: FaultInjector | None = None,
        spec: SpecDecoder | None = None,
    ) -> None:
        self.spec = spec
        """Speculative decoding's acceptance of verified proposals (None: off)."""
        self.structured = structured
        self.sampler = sampler
        self.output_processor = output_processor
        self.beam_search = beam_search
        self.scheduler = scheduler
        """Forks parallel samples (children share the prompt's blocks)."""
        self.requests = requests
        self.new_seq_id = new_seq_id
        self.faults = faults

    def apply(self, result: StepResult, failed: dict[str, str]) -> None:
        """Record prompt logprobs, append sampled tokens and pool embeddings; failures go to ``failed``."""
        self._record_prompt_logprobs(result, failed)
        self._samples(result, failed)
        self._verified(result, failed)
        self._pool(result, failed)

    def _fail(self, failed: dict[str, str], group: SequenceGroup, stage: str, error: Exception) -> None:
        logger.error("request %s failed in %s: %r", group.request_id, stage, error, exc_info=error)
        failed.setdefault(group.request_id, f"{stage} failed: {error!r}")

    def _samples(self, result: StepResult, failed: dict[str, str]) -> None:
        rows = result.inputs.sample_rows
        now = time.monotonic()
        beam_rows: dict[str, list[int]] = {}
        sampled = []
        for i, row in enumerate(rows):
            if row.group.first_token_time is None:
                row.group.first_token_time = now
            if row.group.request_id in failed:
                continue
            if row.group.sampling_params.use_beam_search:
                beam_rows.setdefault(row.group.request_id, []).append(i)
            else:
                sampled.append(i)
        for i, sample in self._sample(result.logits, rows, sampled, failed).items():
            group = rows[i].group
            if group.request_id in failed:
                continue
            try:
                if self.faults is not None:
                    self.faults.check_request(group.request_id)
                self._append(group, rows[i].seq, sample)
            except Exception as exc:
                self._fail(failed, group, "output processing", exc)
        for request_id, indices in beam_rows.items():
            state = self.requests[request_id]
            assert state.beam is not None
            try:
                if self.faults is not None:
                    self.faults.check_request(request_id)
                self.beam_search.step(state.group, state.beam, [rows[i].seq for i in indices], result.logits[indices])
            except Exception as exc:
                self._fail(failed, state.group, "beam search", exc)

    def _verified(self, result: StepResult, failed: dict[str, str]) -> None:
        """Rows that verified proposals: accepted tokens appended (their logits follow the sample rows')."""
        rows = [row for row in result.inputs.spec_rows if row.group.request_id not in failed]
        if not rows:
            return
        assert self.spec is not None
        logits = result.logits[len(result.inputs.sample_rows) :]
        if len(rows) < len(result.inputs.spec_rows):
            keep = {id(row) for row in rows}
            index: list[int] = []
            start = 0
            for row in result.inputs.spec_rows:
                end = start + len(row.draft_token_ids) + 1
                if id(row) in keep:
                    index.extend(range(start, end))
                start = end
            logits = logits[index]
        try:
            verdicts = self.spec.verify(rows, logits)
        except Exception as exc:
            for row in rows:
                self._fail(failed, row.group, "speculative verification", exc)
            return
        for row, (emitted, logprobs) in zip(rows, verdicts):
            try:
                self.spec.apply(row, emitted, logprobs)
            except Exception as exc:
                self._fail(failed, row.group, "output processing", exc)

    def _sample(
        self, logits: torch.Tensor, rows: list[SampleRow], indices: list[int], failed: dict[str, str]
    ) -> dict[int, Sample]:
        """Samples for ``rows[i]``, i in ``indices``; a row whose sampling raises fails its request."""
        if not indices:
            return {}
        try:
            return dict(zip(indices, self._sample_rows(logits, rows, indices)))
        except Exception as exc:
            if len(indices) == 1:
                self._fail(failed, rows[indices[0]].group, "sampling", exc)
                return {}
        samples: dict[int, Sample] = {}
        for i in indices:  # NOTE: one row at a time, to find the rows that raise
            try:
                samples[i] = self._sample_rows(logits, rows, [i])[0]
            except Exception as exc:
                self._fail(failed, rows[i].group, "sampling", exc)
        return samples

    def _sample_rows(self, logits: torch.Tensor, rows: list[SampleRow], indices: list[int]) -> list[Sample]:
        if self.faults is not None:
            self.faults.check_sampler(rows[i].group.request_id for i in indices)
        requests = [self._sample_request(rows[i].group, rows[i].seq) for i in indices]
        constrained = [k for k, i in enumerate(indices) if self.requests[rows[i].group.request_id].grammar is not None]
        if constrained:
            states = [(self.requests[rows[indices[k]].group.request_id], rows[indices[k]].seq) for k in constrained]
            masks = self.structured.masks([state.matcher(seq, self.structured) for state, seq in states])
            for k, mask in zip(constrained, masks):
                requests[k].allowed = mask
        return self.sampler(logits[indices], requests)

    def _sample_request(self, group: SequenceGroup, seq: Sequence) -> SampleRequest:
        first = len(group.seqs) == 1 and not seq.output_token_ids
        state = self.requests[group.request_id]
        params = group.sampling_params
        penalized = params.repetition_penalty != 1.0 or bool(params.presence_penalty or params.frequency_penalty)
        return SampleRequest(
            params,
            seq.prompt_token_ids,
            seq.output_token_ids,
            num_samples=params.best_of if first else 1,
            generator=state.generator,
            eos_token_ids=self.output_processor.eos_token_ids,
            counts=state.token_counts.setdefault(seq.seq_id, TokenCounts()) if penalized else None,
        )

    def _append(self, group: SequenceGroup, seq: Sequence, sample: Sample) -> None:
        """Append the sampled token; the group's first sample forks the other ``best_of - 1``."""
        for i in range(1, len(sample.token_ids)):
            child = self.scheduler.fork(seq, self.new_seq_id())  # NOTE: shares the parent's blocks
            group.seqs.append(child)
            self._append_token(group, child, sample, i)
        self._append_token(group, seq, sample, 0)

    def _append_token(self, group: SequenceGroup, seq: Sequence, sample: Sample, i: int) -> None:
        token = sample.token_ids[i]
        state = self.requests[group.request_id]
        if state.grammar is not None:
            matcher = state.matcher(seq, self.structured)
            if not matcher.accept_token(token):
                raise RuntimeError(f"the grammar refused token {token} that its own mask allowed")
        self.output_processor.append_token(
            seq, token, sample.logprobs[i], sample.top_logprobs[i], group.sampling_params
        )
        if (
            state.grammar is not None
            and state.matcher(seq, self.structured).is_terminated()
            and not seq.status.finished
        ):
            seq.status = SequenceStatus.FINISHED_STOPPED  # NOTE: the grammar is complete: nothing may follow

    def _record_prompt_logprobs(self, result: StepResult, failed: dict[str, str]) -> None:
        rows = result.inputs.prompt_rows
        if not rows:
            return
        assert result.prompt_logits is not None
        logprobs = torch.log_softmax(result.prompt_logits.float().cpu(), dim=-1)
        index = 0
        for row in rows:
            first, index = index, index + len(row.prompt_positions)
            try:
                self._append_prompt_logprobs(row, logprobs[first:index])
            except Exception as exc:
                self._fail(failed, row.group, "prompt logprobs", exc)

    @staticmethod
    def _append_prompt_logprobs(row: SampleRow, logprobs: torch.Tensor) -> None:
        group = row.group
        if not group.prompt_logprobs:
            group.prompt_logprobs = [None]  # the first prompt token has no logprob
        for position, row_logprobs in zip(row.prompt_positions, logprobs):
            token = row.seq.prompt_token_ids[position]
            group.prompt_logprobs.append(top_logprobs(row_logprobs, token, group.sampling_params.prompt_logprobs))

    def _pool(self, result: StepResult, failed: dict[str, str]) -> None:
        rows = result.inputs.pool_rows
        if not rows:
            return
        assert result.pooled is not None
        for row, pooled in zip(rows, result.pooled):
            if row.group.request_id in failed:
                continue
            try:
                if self.faults is not None:
                    self.faults.check_request(row.group.request_id)
                self._add_pooled(self.requests[row.group.request_id], row, pooled)
            except Exception as exc:
                self._fail(failed, row.group, "pooling", exc)

    @staticmethod
    def _add_pooled(state: RequestState, row: PoolRow, pooled: torch.Tensor) -> None:
        """Add a chunk's hidden-state sum; the chunk ending the prompt finishes the request with its embedding."""
        # NOTE: a prompt preempted by recomputation starts again from position 0: so does its sum.
        if row.start == 0 or state.pooled is None:
            state.pooled, state.num_pooled = torch.zeros_like(pooled), 0
        state.pooled += pooled
        state.num_pooled += row.num
        if not row.completes_prompt:
            return
        params = row.group.pooling_params
        assert params is not None
        embedding = state.pooled / state.num_pooled
        if params.normalize:
            embedding = torch.nn.functional.normalize(embedding, p=2.0, dim=0)
        state.embedding = embedding
        row.seq.status = SequenceStatus.FINISHED_STOPPED
