"""Streaming responses, shared by the completion and chat endpoints: what each choice has
already sent (:class:`Tracker`), the merged outputs of a request's prompts, the deadline
of ``--request-timeout``, and the SSE chunks. The endpoints pass in only how a choice
looks (:data:`ChoiceMaker`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pagedllm.server.engine.request_stream import RequestStream
from pagedllm.server.entrypoints.openai.protocol import StreamOptions, UsageInfo
from pagedllm.server.entrypoints.openai.serving import OpenAIServing, Prompt, cached_prompt_tokens, usage
from pagedllm.server.entrypoints.openai.sse import SSEResponse, sse_response
from pagedllm.server.outputs import CompletionOutput, EngineOutput, RequestOutput
from pagedllm.server.sampling_params import SamplingParams

_T = TypeVar("_T")


@dataclass
class Delta:
    """What a streamed choice gained since the last chunk."""

    text: str
    token_start: int
    token_end: int
    finish_reason: str | None
    stop_reason: Any


@dataclass
class Tracker:
    """What one choice already sent to a streaming client."""

    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    """Endpoint-specific progress (the completion endpoint's echo and text offset)."""

    def advance(self, c: CompletionOutput, holdback: int, with_tokens: bool) -> Delta | None:
        """The news in ``c``, or None if there is nothing to send.

        NOTE: the last ``holdback`` characters wait until the choice finishes, because
        they may yet turn out to begin a stop string, which is never sent.
        """
        if self.finished:
            return None
        end = len(c.text) if c.finish_reason else max(self.text_len, len(c.text) - holdback)
        text = c.text[self.text_len : end]
        new_tokens = len(c.token_ids) > self.num_tokens
        if not text and not (with_tokens and new_tokens) and not c.finish_reason:
            return None
        delta = Delta(text, self.num_tokens, len(c.token_ids), c.finish_reason, c.stop_reason)
        self.text_len, self.num_tokens, self.finished = end, len(c.token_ids), c.finish_reason is not None
        return delta


ChoiceMaker = Callable[
    [int, int, RequestOutput, CompletionOutput, Tracker], dict[str, Any] | list[dict[str, Any]] | None
]
"""(prompt index, choice index, the request's output, the choice, its tracker) -> a chunk's choice,
several successive ones (each goes out in a chunk of its own, in order), or None for nothing new."""


def holdback(params: SamplingParams) -> int:
    """Characters a stream keeps back: one less than the longest stop string."""
    return max((len(s) for s in params.stop_list), default=1) - 1


def generated(output: EngineOutput) -> RequestOutput:
    """A generation request's output (streams carry generations only; embeddings are never streamed)."""
    assert isinstance(output, RequestOutput), f"a stream got a {type(output).__name__}"
    return output


async def merged(
    serving: OpenAIServing, streams: list[RequestStream]
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(prompt index, output) from every stream as they come."""
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, generated(output)
        finally:
            serving.abort(streams)  # NOTE: a no-op for finished requests
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in serving.engine.iterate(stream):
                queue.put_nowait((i, generated(output), None))
        except BaseException as exc:  # noqa: BLE001 (forwarded to the consumer)
            queue.put_nowait((i, None, exc))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                remaining -= 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        serving.abort(streams)


async def until_timeout(serving: OpenAIServing, items: AsyncGenerator[_T, None]) -> AsyncIterator[_T]:
    """``items`` until ``request_timeout`` after the first is awaited; then :meth:`timed_out`."""
    deadline = None if serving.request_timeout is None else time.monotonic() + serving.request_timeout
    try:
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                item = await asyncio.wait_for(anext(items), remaining)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError as exc:
                raise serving.timed_out() from exc
            yield item
    finally:
        await items.aclose()


# -- streaming --------------------------------------------------------------------------------------
def stream(
    serving: OpenAIServing,
    request_id: str,
    object_name: str,
    prompts: list[Prompt],
    params: SamplingParams,
    streams: list[RequestStream],
    options: StreamOptions | None,
    make_choice: ChoiceMaker,
    first_choices: list[dict[str, Any]] | None = None,
) -> SSEResponse:
    """The SSE response of a streaming request: one chunk per step with news, then usage if asked
    (``include_usage``; with ``continuous_usage_stats`` every chunk carries the usage so far)."""
    created = int(time.time())
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    trackers: dict[int, Tracker] = {}
    latest: dict[int, RequestOutput] = {}  # prompt index -> its newest output

    def so_far() -> UsageInfo:
        # NOTE: a choice maker that tells reasoning apart keeps its count in tracker.extra["reasoning_tokens"]
        reasoning = [t.extra["reasoning_tokens"] for t in trackers.values() if "reasoning_tokens" in t.extra]
        return usage(
            prompts,
            sum(t.num_tokens for t in trackers.values()),
            cached_prompt_tokens(latest.values()),
            sum(reasoning) if reasoning else None,
        )

    def chunk(choices: list[dict[str, Any]], final: UsageInfo | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": request_id,
            "object": object_name,
            "created": created,
            "model": serving.model_name,
            "choices": choices,
        }
        if continuous:
            body["usage"] = (final or so_far()).model_dump()
        elif include_usage:
            body["usage"] = final.model_dump() if final else None
        return body

    started = time.monotonic()

    async def events() -> AsyncIterator[dict[str, Any]]:
        try:
            async for event in chunks():
                yield event
        finally:
            serving.log_access(request_id, prompts, so_far().completion_tokens, started)

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        if first_choices:
            yield chunk(first_choices)
        async for i, output in until_timeout(serving, merged(serving, streams)):
            latest[i] = output
            rounds: list[list[dict[str, Any]]] = []  # NOTE: chunk k carries the k-th delta of each choice
            for c in output.outputs:
                index = i * params.n + c.index
                made = make_choice(i, index, output, c, trackers.setdefault(index, Tracker()))
                for k, choice in enumerate([made] if isinstance(made, dict) else made or []):
                    if k == len(rounds):
                        rounds.append([])
                    rounds[k].append(choice)
            for choices in rounds:
                yield chunk(choices)
        if include_usage:
            yield chunk([], so_far())

    return sse_response(events(), on_close=lambda: serving.abort(streams))
