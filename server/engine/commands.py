"""What the event loop asks of the engine thread: typed commands, run between steps.

NOTE: commands are the only way into :class:`LLMEngine` from outside its thread; the
thread drains the queue between steps, so an abort frees blocks before the next step.
"""

from __future__ import annotations

import concurrent.futures
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.server.engine.input_processor import PromptType
from pagedllm.server.lora_request import LoRARequest
from pagedllm.server.pooling_params import PoolingParams
from pagedllm.server.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.server.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: PromptType
    params: SamplingParams | PoolingParams
    arrival_time: float
    done: concurrent.futures.Future
    """Resolved once the engine queued the request, or failed with its :class:`ConfigError`."""
    lora_request: LoRARequest | None = None


@dataclass(frozen=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True)
class CallEngine:
    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future


@dataclass(frozen=True)
class Wake:
    """Nothing to do: makes a blocked engine thread look at its stop flag."""


Command = AddRequest | AbortRequests | CallEngine | Wake

ARRIVAL_GAP_S = 0.006
"""After a step that finished several requests left the engine idle, it waits for as many
new requests before it steps again, while each follows the one before within this gap."""
ARRIVAL_WINDOW_S = 0.03
"""...and for this long at most, from the first arrival.

NOTE: clients that keep a fixed number of requests in flight send their next ones together
when a step finishes several at once, spread over a few milliseconds as the server writes
each response (8 clients: about 10 ms, 3 ms before the second). An engine that stepped on
the first alone would prefill it a step ahead of the rest: from then on they finish on
different steps, and every later wave's late prompt stalls the decoding sequences for a
whole prompt step (measured with 8 clients, 256-token prompts, 2 CPU cores: about 240 ms,
every wave; a P99 inter-token latency of 240 ms, against 45 ms with the wait). A request that arrives
after the engine has idled (:func:`expected_arrivals`), or after one finished alone, never
waits."""


def expected_arrivals(finished: int) -> int:
    """How many requests an engine that just went idle waits for (see :data:`ARRIVAL_GAP_S`),
    given how many its last step finished: none after a lone one."""
    return finished if finished > 1 else 0


class ArrivalWave:
    """An engine loop's side of :data:`ARRIVAL_GAP_S`, whatever carries its commands: the loop
    sets :attr:`finished` after each step, calls :meth:`begin` when a drain starts, :meth:`took`
    for each command, and waits :meth:`wait_s` for the next one (0: it does not wait)."""

    def __init__(self) -> None:
        self.finished = 0
        """Requests the last step finished."""
        self._expect = 0
        self._deadline = 0.0

    def idled(self) -> None:
        """The engine waited for work and none came: what arrives next is not that step's clients."""
        self.finished = 0

    def begin(self, idle: bool) -> None:
        """A drain starts; ``idle``: the engine has nothing to run (only then does it wait)."""
        self._expect = expected_arrivals(self.finished) if idle else 0
        self.finished = 0
        self._deadline = time.monotonic() + ARRIVAL_WINDOW_S

    def took(self, request: bool) -> None:
        """One command was run; ``request``: it added a request."""
        self._expect -= request

    def wait_s(self) -> float:
        """How long to wait for the next command: 0 once the wave is in or the window has closed."""
        return max(0.0, min(ARRIVAL_GAP_S, self._deadline - time.monotonic())) if self._expect > 0 else 0.0


def execute(engine: LLMEngine, command: Command) -> None:
    """Carry out ``command``; a failure goes to its future, never out of the engine thread."""
    if isinstance(command, AddRequest):
        _run_into(
            command.done,
            engine.add_request,
            command.request_id,
            command.prompt,
            command.params,
            command.arrival_time,
            command.lora_request,
        )
    elif isinstance(command, AbortRequests):
        engine.abort_request(command.request_ids)
    elif isinstance(command, CallEngine):
        _run_into(command.done, command.fn, engine)


def reject(command: Command, error: BaseException) -> None:
    """Fail a command that will never run (the engine stopped); its waiter gets ``error``."""
    if isinstance(command, (AddRequest, CallEngine)) and command.done.set_running_or_notify_cancel():
        command.done.set_exception(error)


def reject_all(commands: queue.SimpleQueue[Command], error: BaseException) -> None:
    """Fail every command still queued (the engine thread is gone)."""
    while True:
        try:
            command = commands.get_nowait()
        except queue.Empty:
            return
        reject(command, error)


def _run_into(done: concurrent.futures.Future[Any], fn: Callable[..., Any], *args: Any) -> None:
    if not done.set_running_or_notify_cancel():
        return
    try:
        done.set_result(fn(*args))
    except Exception as exc:  # noqa: BLE001 (handed to the caller)
        done.set_exception(awaitable_error(exc))


def awaitable_error(exc: BaseException) -> BaseException:
    """``exc``, or a RuntimeError from it where it is a StopIteration.

    NOTE: asyncio refuses a StopIteration as a future's exception (TypeError inside the loop's
    callback), so the awaiting request would never learn its fate and would hang.
    """
    if isinstance(exc, (StopIteration, StopAsyncIteration)):
        error = RuntimeError(f"the engine raised {exc!r}")
        error.__cause__ = exc
        return error
    return exc
