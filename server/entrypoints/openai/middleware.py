"""Pure ASGI middleware: the checks every request passes before a route sees it.

NOTE: pure ASGI (not BaseHTTPMiddleware) so streaming and disconnect detection pass
through untouched.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.server.entrypoints.openai.errors import APIError, error_response, unavailable
from pagedllm.server.entrypoints.openai.serving import OpenAIServing

OPEN_WHILE_DRAINING = ("/health", "/ready", "/metrics", "/version")


class GateMiddleware:
    """503 while draining; Bearer key on ``/v1/*`` (constant-time compare)."""

    def __init__(self, app: ASGIApp, serving: OpenAIServing, api_key: str | None) -> None:
        self.app = app
        self.serving = serving
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        error = None
        if self.serving.draining and path not in OPEN_WHILE_DRAINING:
            error = unavailable("the server is shutting down: retry on another replica")
        elif self.expected is not None and path.startswith("/v1"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(
                    401,
                    "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    type="authentication_error",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if error is None:
            return await self.app(scope, receive, send)
        return await error_response(error)(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a request body over ``max_bytes``, by its Content-Length or as it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: int) -> APIError:
        return APIError(
            413,
            f"the request body is {size} bytes or more: at most {self.max_bytes} are accepted",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope.get("headers") or [])
        if declared is not None and declared > self.max_bytes:
            return await error_response(self._too_large(declared))(scope, receive, send)
        received = 0
        too_large: int | None = None  # NOTE: set once the body passed the limit; the app's answer is replaced
        replaced = False

        async def counting_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = received
                    raise _BodyTooLarge(received)
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal replaced
            if too_large is None:
                await send(message)
            elif not replaced:
                replaced = True
                await error_response(self._too_large(too_large))(scope, receive, send)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _BodyTooLarge:
            if not replaced:
                await error_response(self._too_large(received))(scope, receive, send)


class _BodyTooLarge(Exception):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


def _content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
