"""Outputs as deltas: the engine core sends what a step added, the front end rebuilds the whole.

::

    engine core (DeltaMaker)                      front end (OutputAccumulator)
    group after a step ─► RequestDelta ──ZMQ──►   RequestDelta ─► cumulative RequestOutput
      per choice: tokens, logprobs and text         cut to the delta's starts, append,
      past what was sent for that choice            a RequestOutput the serving code reads

NOTE: a choice's tokens only grow while the same sequence sits at that index, and its text
only grows or is cut back (a stop string cuts it at a point the new token's text reached).
So a delta is "keep the first ``token_start`` tokens and ``text_start`` characters, then
append these". When another sequence takes the index (beam search reorders its beams, a
finished n > 1 request sorts its choices), the delta starts at 0: the choice is sent whole.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from pagedllm.server.core.sequence import SequenceGroup
from pagedllm.server.outputs import CompletionOutput, Logprob, RequestOutput

LogprobsEntry = dict[int, Logprob]


class ChoiceDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one choice gained in a step."""

    index: int
    token_start: int
    """Tokens (and logprobs) the front end keeps before appending ``token_ids``."""
    token_ids: list[int]
    text_start: int
    """Characters of text the front end keeps before appending ``text``."""
    text: str
    cumulative_logprob: float | None
    logprobs_start: int = 0
    logprobs: list[LogprobsEntry] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request gained in a step; the first delta of a request carries its prompt."""

    request_id: str
    finished: bool
    choices: list[ChoiceDelta]
    error: str | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs_start: int = 0
    prompt_logprobs: list[LogprobsEntry | None] | None = None
    num_cached_tokens: int | None = None


class _Sent:
    """What the front end holds of one request: per choice index, (seq id, tokens, logprobs, text length)."""

    __slots__ = ("choices", "num_prompt_logprobs")

    def __init__(self) -> None:
        self.choices: list[tuple[int, int, int, int]] = []
        self.num_prompt_logprobs = 0


class DeltaMaker:
    """Engine-core side: a group's :class:`RequestDelta` since the last one sent for it."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def __call__(self, group: SequenceGroup) -> RequestDelta:
        params = group.sampling_params
        sent = self._sent.get(group.request_id)
        delta = RequestDelta(group.request_id, group.is_finished(), [], num_cached_tokens=group.num_cached_tokens)
        if sent is None:
            sent = self._sent[group.request_id] = _Sent()
            delta.prompt, delta.prompt_token_ids = group.prompt, list(group.prompt_token_ids)
        seqs = group.seqs
        if delta.finished and len(seqs) > params.n and not params.use_beam_search:
            seqs = sorted(seqs, key=lambda s: s.ranking_logprob, reverse=True)
        for i, seq in enumerate(seqs[: params.n]):
            seq_id, num_tokens, num_logprobs, text_len = sent.choices[i] if i < len(sent.choices) else (-1, 0, 0, 0)
            if seq_id != seq.seq_id:
                num_tokens = num_logprobs = text_len = 0
            text_start = min(text_len, len(seq.output_text))
            delta.choices.append(
                ChoiceDelta(
                    i,
                    num_tokens,
                    seq.output_token_ids[num_tokens:],
                    text_start,
                    seq.output_text[text_start:],
                    seq.cumulative_logprob,
                    num_logprobs,
                    seq.output_logprobs[num_logprobs:] if params.logprobs is not None else None,
                    seq.status.value if seq.status.finished else None,
                    seq.stop_reason,
                )
            )
            entry = (seq.seq_id, len(seq.output_token_ids), len(seq.output_logprobs), len(seq.output_text))
            sent.choices[i : i + 1] = [entry]
        self._prompt_logprobs(group, sent, delta)
        if delta.finished:
            del self._sent[group.request_id]
        return delta

    @staticmethod
    def _prompt_logprobs(group: SequenceGroup, sent: _Sent, delta: RequestDelta) -> None:
        if group.sampling_params.prompt_logprobs is None or group.prompt_logprobs is None:
            return
        start = min(sent.num_prompt_logprobs, len(group.prompt_logprobs))
        delta.prompt_logprobs_start, delta.prompt_logprobs = start, group.prompt_logprobs[start:]
        sent.num_prompt_logprobs = len(group.prompt_logprobs)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop what was sent for aborted requests."""
        for request_id in request_ids:
            self._sent.pop(request_id, None)


class _Choice:
    __slots__ = ("token_ids", "logprobs", "text")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[LogprobsEntry] | None = None
        self.text = ""


class _Request:
    __slots__ = ("prompt", "prompt_token_ids", "prompt_logprobs", "choices")

    def __init__(self, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs: list[LogprobsEntry | None] | None = None
        self.choices: list[_Choice] = []


class OutputAccumulator:
    """Front-end side: deltas in, the cumulative :class:`RequestOutput` the in-process engine would give."""

    def __init__(self) -> None:
        self._requests: dict[str, _Request] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, delta: RequestDelta) -> RequestOutput | None:
        """The request's output after ``delta``; None for a delta of a request already forgotten."""
        state = self._requests.get(delta.request_id)
        if state is None:
            if delta.prompt_token_ids is None:
                return None
            state = self._requests[delta.request_id] = _Request(delta.prompt, delta.prompt_token_ids)
        completions = [self._apply(state, choice) for choice in delta.choices]
        if delta.prompt_logprobs is not None:
            state.prompt_logprobs = (state.prompt_logprobs or [])[: delta.prompt_logprobs_start] + delta.prompt_logprobs
        if delta.finished:
            del self._requests[delta.request_id]
        return RequestOutput(
            delta.request_id,
            state.prompt,
            state.prompt_token_ids,
            state.prompt_logprobs,
            completions,
            delta.finished,
            error=delta.error,
            num_cached_tokens=delta.num_cached_tokens,
        )

    @staticmethod
    def _apply(state: _Request, delta: ChoiceDelta) -> CompletionOutput:
        while len(state.choices) <= delta.index:
            state.choices.append(_Choice())
        choice = state.choices[delta.index]
        # NOTE: the lists are replaced, never grown in place: an output handed out earlier keeps its own.
        choice.token_ids = choice.token_ids[: delta.token_start] + delta.token_ids
        if delta.logprobs is not None:
            choice.logprobs = (choice.logprobs or [])[: delta.logprobs_start] + delta.logprobs
        choice.text = choice.text[: delta.text_start] + delta.text
        return CompletionOutput(
            index=delta.index,
            text=choice.text,
            token_ids=choice.token_ids,
            cumulative_logprob=delta.cumulative_logprob,
            logprobs=choice.logprobs if delta.logprobs is not None else None,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop aborted requests (the engine core sends nothing more for them)."""
        for request_id in request_ids:
            self._requests.pop(request_id, None)
