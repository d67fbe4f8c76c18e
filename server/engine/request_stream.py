"""One request's outputs as an async stream, and the error every stream ends with if the engine dies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedllm.server.outputs import EngineOutput


class EngineDeadError(RuntimeError):
    """The engine thread stopped (it failed, or the server is shutting down)."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine; the engine itself goes on serving the others."""


@dataclass
class StepTimes:
    """When the step that produced an output started and ended (``time.monotonic``)."""

    start: float
    end: float


class RequestStream:
    """One request's outputs. Outputs carry cumulative state, so only the newest is kept."""

    def __init__(self, request_id: str, arrival_time: float) -> None:
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.finished = False
        self.scheduled = False  # NOTE: set by the first output, i.e. once the request left the queue
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_tokens = 0
        self._latest: EngineOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    def put(self, output: EngineOutput) -> None:
        self._latest = output
        self.finished = output.finished
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self.finished = True
        self._event.set()

    async def __aiter__(self) -> AsyncIterator[EngineOutput]:
        while True:
            await self._event.wait()
            self._event.clear()
            if self._error is not None:
                raise self._error
            output, self._latest = self._latest, None
            if output is not None:
                yield output
                if output.finished:
                    return
