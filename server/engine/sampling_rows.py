"""What the worker's sampler needs to know about each row of a step, and its answers read back.

:class:`SamplingRows` turns a step's rows (:class:`~pagedllm.server.engine.step_inputs.StepInputs`)
into a :class:`~pagedllm.server.worker.sampling_batch.SamplingBatch`: per logits row, the
request's sampling parameters as plain values, the tokens its penalties read, the ids
``min_tokens`` still bans and, for structured outputs, the grammar's bitmask (filled here on
the host by xgrammar; the worker applies it). The worker answers with token ids and the
log-probabilities asked for (:func:`logprob_dicts` makes them vLLM's ``Logprob`` entries).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from pagedllm.server.core.sequence import Sequence, SequenceGroup
from pagedllm.server.engine.step_inputs import SampleRow, SpecRow, StepInputs
from pagedllm.server.engine.structured_output import StructuredOutputs
from pagedllm.server.outputs import Logprob
from pagedllm.server.sampling_params import SamplingParams
from pagedllm.server.worker.sampling_batch import PromptScoring, RowSampling, SamplingBatch, SpecVerify, Tokens

logger = logging.getLogger("pagedllm.engine")


class SamplingRows:
    """Describes each step's rows for the worker's sampler; remembers which seeded requests ended."""

    def __init__(self, requests: Mapping[str, Any], structured: StructuredOutputs, eos_token_ids: tuple[int, ...]):
        self.requests = requests
        """request id -> RequestState (the engine's; read for grammars and their matchers)."""
        self.structured = structured
        self.eos_token_ids = eos_token_ids
        self._finished: list[str] = []
        self._plain: dict[tuple[str, int], RowSampling] = {}
        """(request id, samples) -> the row of a request whose rows are the same every step (reused)."""

    def finished(self, request_id: str, params: SamplingParams) -> None:
        """Note a request that ended; the next step tells the worker to drop its generator."""
        self._plain.pop((request_id, 1), None)
        if params.seed is not None:
            self._finished.append(request_id)

    def build(self, inputs: StepInputs, failed: dict[str, str]) -> SamplingBatch:
        """The step's sampling batch; a row that cannot be described fails its request (in ``failed``)."""
        rows = [self._sample_row(row) for row in inputs.sample_rows]
        self._add_masks(inputs.sample_rows, rows, failed)
        verify = []
        for row in inputs.spec_rows:
            verify.append(SpecVerify(len(rows), tuple(row.draft_token_ids)))
            rows.extend(self._spec_rows(row))
        prompts = [_prompt_scoring(row) for row in inputs.prompt_rows]
        finished, self._finished = self._finished, []
        return SamplingBatch(rows, len(inputs.sample_rows), verify, prompts, finished)

    def _sample_row(self, row: SampleRow) -> RowSampling:
        group, seq = row.group, row.seq
        params = group.sampling_params
        if params.use_beam_search:
            eos = () if params.ignore_eos else self.eos_token_ids
            return RowSampling(group.request_id, num_beam_candidates=max(2, 1 + len(eos)) * params.best_of)
        first = len(group.seqs) == 1 and not seq.output_token_ids
        return self._row(group, seq, seq.output_token_ids, params.best_of if first else 1)

    def _spec_rows(self, row: SpecRow) -> list[RowSampling]:
        # NOTE: the row at position i sees the proposals before it as output (penalties, min_tokens).
        output = row.seq.output_token_ids
        drafts = row.draft_token_ids
        return [self._row(row.group, row.seq, output + drafts[:i] if i else output, 1) for i in range(len(drafts) + 1)]

    def _row(self, group: SequenceGroup, seq: Sequence, output: list[int], num_samples: int) -> RowSampling:
        params = group.sampling_params
        penalized = params.repetition_penalty != 1.0 or bool(params.presence_penalty or params.frequency_penalty)
        if penalized or len(output) < params.min_tokens:
            return self._new_row(group, seq, output, num_samples, penalized)
        # NOTE: without penalties or a min_tokens ban a request's rows do not change from step to step
        key = (group.request_id, num_samples)
        row = self._plain.get(key)
        if row is None:
            row = self._new_row(group, seq, output, num_samples, penalized)
            if num_samples == 1:
                self._plain[key] = row
        return row

    def _new_row(
        self, group: SequenceGroup, seq: Sequence, output: list[int], num_samples: int, penalized: bool
    ) -> RowSampling:
        params = group.sampling_params
        needs_logprobs = (
            not params.greedy or params.logprobs is not None or params.best_of > params.n or num_samples > 1
        )
        return RowSampling(
            group.request_id,
            temperature=0.0 if params.greedy else params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            seed=params.seed,
            num_samples=num_samples,
            needs_logprobs=needs_logprobs,
            num_logprobs=params.logprobs,
            logit_bias=tuple(params.logit_bias.items()) if params.logit_bias else (),
            banned_token_ids=self._banned(params, len(output)),
            prompt_token_ids=np.asarray(seq.prompt_token_ids, dtype=np.int64) if penalized else None,
            output_token_ids=np.asarray(output, dtype=np.int64) if penalized else None,
        )

    def _banned(self, params: SamplingParams, num_output: int) -> tuple[int, ...]:
        """Before ``min_tokens`` are generated, EOS and the stop token ids cannot be chosen."""
        if num_output >= params.min_tokens:
            return ()
        banned = list(params.stop_token_ids)
        if not params.ignore_eos:
            banned += list(self.eos_token_ids)
        return tuple(banned)

    def _add_masks(self, sample_rows: list[SampleRow], rows: list[RowSampling], failed: dict[str, str]) -> None:
        """Fill the grammar bitmask of every constrained row (one xgrammar batch; row by row if it raises)."""
        constrained = [i for i, row in enumerate(sample_rows) if self._grammar_state(row) is not None]
        if not constrained:
            return
        masks: list[np.ndarray | None]
        try:
            masks = list(self._masks([sample_rows[i] for i in constrained]))
        except Exception:
            masks = []
            for i in constrained:  # NOTE: one at a time, to find the rows that raise
                try:
                    masks.extend(self._masks([sample_rows[i]]))
                except Exception as exc:
                    logger.error("request %s failed in sampling: %r", sample_rows[i].group.request_id, exc)
                    failed.setdefault(sample_rows[i].group.request_id, f"sampling failed: {exc!r}")
                    masks.append(None)
        for i, mask in zip(constrained, masks):
            if mask is not None:
                rows[i] = dataclasses.replace(rows[i], allowed=mask)

    def _grammar_state(self, row: SampleRow) -> Any:
        state = self.requests.get(row.group.request_id)
        if state is None or state.grammar is None or row.group.sampling_params.use_beam_search:
            return None
        return state

    def _masks(self, rows: list[SampleRow]) -> list[np.ndarray | None]:
        matchers = [self._grammar_state(row).matcher(row.seq, self.structured) for row in rows]
        return list(self.structured.masks(matchers))


def _prompt_scoring(row: SampleRow) -> PromptScoring:
    prompt = row.seq.prompt_token_ids
    num = row.group.sampling_params.prompt_logprobs
    assert num is not None  # NOTE: only requests asking for prompt logprobs have prompt rows
    return PromptScoring(row.group.request_id, tuple(prompt[p] for p in row.prompt_positions), num)


def logprob_dicts(tokens: Tokens) -> list[dict[int, Logprob] | None]:
    """Per token: the top log-probabilities at its position plus the token itself, with ranks (None: not asked)."""
    if tokens.top is None or tokens.ranks is None or tokens.logprobs is None:
        return [None] * len(tokens.token_ids)
    dicts: list[dict[int, Logprob] | None] = []
    for token, logprob, rank, top in zip(tokens.token_ids, tokens.logprobs, tokens.ranks, tokens.top):
        entry = {t: Logprob(v, i + 1) for i, (t, v) in enumerate(top)}
        if token not in entry:
            entry[token] = Logprob(logprob, rank)
        dicts.append(entry)
    return dicts
