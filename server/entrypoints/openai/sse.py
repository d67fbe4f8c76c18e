"""Server-sent events: JSON chunks, an error event if the engine dies, then ``[DONE]``."""

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


def sse_response(events: AsyncIterator[dict[str, Any]], on_close: Callable[[], None]) -> SSEResponse:
    """Each event as a ``data:`` line; a dead engine ends the stream with an error event in OpenAI's shape."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except EngineDeadError as exc:
            yield f"data: {json.dumps(unavailable(str(exc)).body())}\n\n"
        except RequestFailedError as exc:
            yield f"data: {json.dumps(internal_error(str(exc)).body())}\n\n"
        except APIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        yield "data: [DONE]\n\n"

    return SSEResponse(body(), on_close=on_close)
