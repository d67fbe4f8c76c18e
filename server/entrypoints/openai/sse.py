"""Server-sent events: JSON chunks, an error event if the engine dies, then ``[DONE]`` (or, for the
Responses API, named events ending with the last one)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedllm.server.engine.request_stream import EngineDeadError, RequestFailedError
from pagedllm.server.entrypoints.openai.errors import APIError, internal_error, unavailable


class SSEResponse(StreamingResponse):
    """Server-sent events; ``on_close`` runs however the response ends (done, error, disconnect)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse_response(
    events: AsyncIterator[dict[str, Any]],
    on_close: Callable[[], None],
    *,
    named: bool = False,
    error_event: Callable[[APIError], dict[str, Any]] = APIError.body,
) -> SSEResponse:
    """Each event as a ``data:`` line; a dead engine or a failed request ends the stream with
    ``error_event`` of the error (OpenAI's error shape by default).

    ``named``: each event also gets an ``event:`` line naming its ``type`` and the stream ends
    with its last event, not ``[DONE]`` (the Responses API's form)."""

    def frame(event: dict[str, Any]) -> str:
        data = f"data: {json.dumps(event)}\n\n"
        return f"event: {event['type']}\n{data}" if named else data

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield frame(event)
        except (EngineDeadError, RequestFailedError, APIError) as exc:
            yield frame(error_event(stream_error(exc)))
        if not named:
            yield "data: [DONE]\n\n"

    return SSEResponse(body(), on_close=on_close)


def stream_error(exc: EngineDeadError | RequestFailedError | APIError) -> APIError:
    """What a client is told when its stream fails: 503 if the engine died, 500 if its request failed."""
    if isinstance(exc, EngineDeadError):
        return unavailable(str(exc))
    if isinstance(exc, RequestFailedError):
        return internal_error(str(exc))
    return exc
