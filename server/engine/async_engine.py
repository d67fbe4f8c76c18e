"""The engine on its own thread, with an async stream of outputs per request.

::

    event loop (HTTP)                         engine thread (owns LLMEngine)
    ─────────────────                         ──────────────────────────────
    add_request ──► commands (SimpleQueue) ──► between steps: add / abort / call
    RequestStream ◄── call_soon_threadsafe ◄── step() -> [EngineOutput] per step

NOTE: only the engine thread touches :class:`LLMEngine`. Everything else reaches it
through the command queue, which the thread drains between steps, so an abort frees the
request's blocks before the next step runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from pagedllm.server.config import ConfigError, EngineConfig
from pagedllm.server.engine.commands import (
    AbortRequests,
    AddRequest,
    ArrivalWave,
    CallEngine,
    Command,
    Wake,
    execute,
    reject_all,
)
from pagedllm.server.engine.engine_stats import EngineStats
from pagedllm.server.engine.input_processor import PromptType
from pagedllm.server.engine.model_info import ModelInfo, load_tokenizer
from pagedllm.server.engine.request_stream import EngineDeadError, RequestFailedError, RequestStream, StepTimes
from pagedllm.server.lora_request import LoRARequest
from pagedllm.server.outputs import EngineOutput
from pagedllm.server.pooling_params import PoolingParams
from pagedllm.server.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.server.engine.llm_engine import LLMEngine

logger = logging.getLogger("pagedllm.async_engine")

STATS_INTERVAL_S = 0.05


class StatsSnapshots:
    """The engine's newest :class:`EngineStats`, taken on the engine thread after steps."""

    def __init__(self) -> None:
        self.latest: EngineStats | None = None
        self._time = 0.0

    def take(self, engine: LLMEngine, force: bool) -> None:
        """Snapshot now if ``force`` or if the last one is older than ``STATS_INTERVAL_S``."""
        now = time.monotonic()
        if force or now - self._time >= STATS_INTERVAL_S:
            self.latest, self._time = engine.stats(), now


class AsyncLLMEngine:
    """Runs :class:`LLMEngine` in a thread; ``generate`` yields outputs as async iterators.

    ``observer`` (optional) is called on the event loop with ``(stream, output, times)``
    for every output, and with ``(stream, None, None)`` when a request is aborted; the
    metrics use it.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        warmup: bool = True,
        engine_factory: Callable[[EngineConfig], LLMEngine] | None = None,
        observer: Callable[..., None] | None = None,
    ) -> None:
        self.config = config
        self.observer = observer
        self._warmup = warmup
        self._factory = engine_factory or _new_engine
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._wave = ArrivalWave()
        self._ready = threading.Event()
        self._loaded: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        self.model_info: ModelInfo | None = None
        """Set once the model is loaded."""
        self.tokenizer: Any = None  # NOTE: the HTTP side's own copy; the engine thread keeps its own
        self._stats = StatsSnapshots()

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; it loads the model, runs a warm-up request, then serves."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loaded = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    async def wait_until_ready(self, timeout: float | None = None) -> None:
        """Wait for the model to load; re-raises a load failure."""
        assert self._loaded is not None, "start() first"
        await asyncio.wait_for(asyncio.shield(self._loaded), timeout)

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self.is_alive

    @property
    def is_alive(self) -> bool:
        """False once the engine thread has failed or stopped."""
        return self.error is None and self._thread is not None and self._thread.is_alive()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still in flight end with :class:`EngineDeadError`."""
        self._stopping.set()
        self._send(Wake())
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        reject_all(self._commands, EngineDeadError("the server is shutting down"))
        self._fail_all(EngineDeadError("the server is shutting down"))

    # -- requests -----------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        """Requests added and not yet finished or aborted."""
        return len(self._streams)

    @property
    def num_unscheduled(self) -> int:
        """Requests added that have not run a step yet (the waiting queue, as seen from here)."""
        return sum(1 for s in self._streams.values() if not s.scheduled)

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a request (with a LoRA adapter if given); the engine's :class:`ConfigError` (bad prompt,
        params or adapter) is re-raised here."""
        if not self.is_ready:
            raise EngineDeadError(self.not_ready_reason())
        if request_id in self._streams:
            raise ConfigError("request_id", request_id, "give each request its own id", problem="is already in use")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        stream = RequestStream(request_id, arrival)
        self._streams[request_id] = stream
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(AddRequest(request_id, prompt, params, arrival, done, lora_request))
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            self._streams.pop(request_id, None)
            rejected = done.done() and not done.cancelled() and done.exception() is not None
            if not rejected:  # cancelled while waiting: the engine may hold it already
                self._send(AbortRequests([request_id]))
                if self.observer is not None:
                    self.observer(stream, None, None)
            raise
        return stream

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        request_id: str,
        arrival_time: float | None = None,
    ) -> AsyncIterator[EngineOutput]:
        """Outputs of one request until it finishes; closing the iterator early aborts it."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        try:
            async for output in stream:
                yield output
        finally:
            # NOTE: not delegated to iterate(): a nested generator is only closed when collected.
            if not stream.finished:
                self.abort(stream.request_id)

    async def iterate(self, stream: RequestStream) -> AsyncIterator[EngineOutput]:
        """Outputs of an added request; if the consumer stops early the request is aborted."""
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (safe from the event loop; idempotent). Its blocks are freed before the next step."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.finished = True
        self._send(AbortRequests([request_id]))
        if self.observer is not None:
            self.observer(stream, None, None)

    def abort_all(self, reason: str) -> int:
        """Abort every request in flight; their consumers get :class:`EngineDeadError` with ``reason``."""
        streams = list(self._streams.values())
        for stream in streams:
            self.abort(stream.request_id)
            stream.fail(EngineDeadError(reason))
        return len(streams)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        return await asyncio.wrap_future(self.submit(fn))

    def submit(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Like :meth:`call`, from any thread: a future of ``fn(engine)`` run between steps."""
        if not self.is_alive:
            raise EngineDeadError(self.not_ready_reason())
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(CallEngine(fn, done))
        return done

    def stats(self) -> EngineStats | None:
        """The newest snapshot of the engine's counters (taken after steps, at most every 50 ms)."""
        return self._stats.latest

    def _send(self, command: Command) -> None:
        """Hand ``command`` to the engine; it runs between steps."""
        self._commands.put(command)

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        engine: LLMEngine | None = None
        try:
            engine = self._factory(self.config)
            self._load(engine)
            self._loop_forever(engine)
        except BaseException as exc:  # noqa: BLE001 (reported to every waiter)
            logger.exception("the engine is dead" if self._ready.is_set() else "the engine failed to start")
            self._die(exc)
        finally:
            if engine is not None:
                engine.shutdown()

    def _load(self, engine: LLMEngine) -> None:
        if self._warmup:
            engine.warm_up()
        self.model_info = engine.model_info
        if engine.tokenizer is not None:
            self.tokenizer = load_tokenizer(self.model_info.tokenizer_dir)
        self._stats.take(engine, force=True)
        self._ready.set()
        assert self._loop is not None and self._loaded is not None
        self._loop.call_soon_threadsafe(_resolve, self._loaded, None)

    def _loop_forever(self, engine: LLMEngine) -> None:
        while not self._stopping.is_set():
            self._drain_commands(engine, block=not engine.has_unfinished_requests())
            if self._stopping.is_set():
                break
            if engine.has_unfinished_requests():
                start = time.monotonic()
                outputs = engine.step()
                times = StepTimes(start, time.monotonic())
                self._wave.finished = sum(1 for output in outputs if output.finished)
                if outputs and self._loop is not None:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs, times)
            self._stats.take(engine, force=not engine.has_unfinished_requests())
            engine.check_health()

    def _drain_commands(self, engine: LLMEngine, block: bool) -> None:
        """Run the commands queued; when ``block`` (the engine is idle), wait for the first, and
        after a step that finished several requests, for as many (``commands.ArrivalWave``)."""
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            self._wave.idled()
            return
        self._wave.begin(idle=block)
        while True:
            execute(engine, command)
            self._wave.took(isinstance(command, AddRequest))
            wait = self._wave.wait_s()
            try:
                command = self._commands.get(timeout=wait) if wait > 0 else self._commands.get_nowait()
            except queue.Empty:
                return

    # -- back on the event loop -------------------------------------------------------------
    def _dispatch(self, outputs: list[EngineOutput], times: StepTimes) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted meanwhile; the engine drops it on the next command drain
            if self.observer is not None:
                self.observer(stream, output, times)
            stream.scheduled = True
            if output.error is not None:
                stream.fail(RequestFailedError(f"request {output.request_id} failed: {output.error}"))
            else:
                stream.put(output)
            if output.finished:
                del self._streams[output.request_id]

    def _die(self, exc: BaseException) -> None:
        self.error = exc
        reject_all(self._commands, EngineDeadError(f"the engine failed: {exc!r}"))
        if self._loop is None or self._loop.is_closed() or self._loaded is None:
            return
        self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"the engine failed: {exc!r}"))
        self._loop.call_soon_threadsafe(_reject, self._loaded, exc)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()

    def not_ready_reason(self) -> str:
        if self.error is not None:
            return f"the engine failed: {self.error!r}"
        if self._stopping.is_set():
            return "the engine is shutting down"
        return "the model is still loading"


def _resolve(future: asyncio.Future[None], value: None) -> None:
    if not future.done():
        future.set_result(value)


def _reject(future: asyncio.Future[None], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
        future.exception()  # NOTE: marks it retrieved, so an unawaited failure is not logged twice


def _new_engine(config: EngineConfig) -> LLMEngine:
    """The engine, imported on the engine thread: importing this module loads no torch."""
    from pagedllm.server.engine.llm_engine import LLMEngine

    return LLMEngine(config)
