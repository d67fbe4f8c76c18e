"""The engine on its own thread, with an async stream of outputs per request.

::

    event loop (HTTP)                         engine thread (owns LLMEngine)
    ─────────────────                         ──────────────────────────────
    add_request ──► commands (SimpleQueue) ──► between steps: add / abort / call
    RequestStream ◄── call_soon_threadsafe ◄── step() -> [RequestOutput] per step

NOTE: only the engine thread touches :class:`LLMEngine`. Everything else reaches it
through the command queue, which the thread drains between steps, so an abort frees the
request's blocks before the next step runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from pagedllm.server.config import EngineConfig
from pagedllm.server.engine import EngineStats, LLMEngine, PromptType
from pagedllm.server.outputs import RequestOutput
from pagedllm.server.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.async_engine")

WARMUP_REQUEST_ID = "pagedllm-warmup"
STATS_INTERVAL_S = 0.05


class EngineDeadError(RuntimeError):
    """The engine thread stopped (it failed, or the server is shutting down)."""


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP side needs to know about the loaded model (read-only)."""

    model_dir: str
    tokenizer_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    default_sampling: dict = field(default_factory=dict)
    """Sampling defaults from the model's generation_config.json (temperature, top_p, ...)."""


@dataclass
class StepTimes:
    start: float
    end: float


class RequestStream:
    """One request's outputs. Outputs carry cumulative state, so only the newest is kept."""

    def __init__(self, request_id: str, arrival_time: float) -> None:
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.finished = False
        self.scheduled = False  # NOTE: set by the first output, i.e. once the request left the queue
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.num_tokens = 0
        self._latest: Optional[RequestOutput] = None
        self._error: Optional[BaseException] = None
        self._event = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self._latest = output
        self.finished = output.finished
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self.finished = True
        self._event.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
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


class AsyncLLMEngine:
    """Runs :class:`LLMEngine` in a thread; ``generate`` yields outputs as async iterators.

    ``observer`` (optional) is called on the event loop with ``(stream, output, times)``
    for every output, and with ``(stream, None, None)`` when a request is aborted; the
    metrics use it.
    """

    def __init__(self, config: EngineConfig, *, warmup: bool = True,
                 engine_factory: Callable[[EngineConfig], LLMEngine] = LLMEngine,
                 observer: Optional[Callable[..., None]] = None) -> None:
        self.config = config
        self.observer = observer
        self._warmup = warmup
        self._factory = engine_factory
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._loaded: Optional[asyncio.Future] = None
        self.error: Optional[BaseException] = None
        self.model_info: Optional[ModelInfo] = None
        self.tokenizer = None  # NOTE: the HTTP side's own copy; the engine thread keeps its own
        self._stats: Optional[EngineStats] = None
        self._stats_time = 0.0

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; it loads the model, runs one warm-up step, then serves."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loaded = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    async def wait_until_ready(self, timeout: Optional[float] = None) -> None:
        """Wait for the model to load; re-raises a load failure."""
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
        self._commands.put(("wake",))
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        self._reject_pending(EngineDeadError("the server is shutting down"))
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

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: Optional[float] = None) -> RequestStream:
        """Queue a request; ``ValueError`` from the engine (bad prompt or params) is re-raised here."""
        if not self.is_ready:
            raise EngineDeadError(self.not_ready_reason())
        if request_id in self._streams:
            raise ValueError(f"request_id={request_id!r} is already in use")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        stream = RequestStream(request_id, arrival)
        self._streams[request_id] = stream
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", request_id, prompt, params, arrival, done))
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            self._streams.pop(request_id, None)
            rejected = done.done() and not done.cancelled() and done.exception() is not None
            if not rejected:  # cancelled while waiting: the engine may hold it already
                self._commands.put(("abort", [request_id]))
                if self.observer is not None:
                    self.observer(stream, None, None)
            raise
        return stream

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       arrival_time: Optional[float] = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes; closing the iterator early aborts it."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        try:
            async for output in stream:
                yield output
        finally:
            # NOTE: not delegated to iterate(): a nested generator is only closed when collected.
            if not stream.finished:
                self.abort(stream.request_id)

    async def iterate(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
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
        self._commands.put(("abort", [request_id]))
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
        self._commands.put(("call", fn, done))
        return done

    def stats(self) -> Optional[EngineStats]:
        """The newest snapshot of the engine's counters (taken after steps, at most every 50 ms)."""
        return self._stats

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._load()
        except BaseException as exc:  # noqa: BLE001 (reported to every waiter)
            logger.exception("engine failed to start")
            self._die(exc)
            return
        try:
            self._loop_forever(engine)
        except BaseException as exc:  # noqa: BLE001
            logger.exception("engine step failed; the engine is dead")
            self._die(exc)

    def _load(self) -> LLMEngine:
        engine = self._factory(self.config)
        if self._warmup:
            _warm_up(engine)
        model_dir = engine.config.model.model
        self.model_info = ModelInfo(model_dir=model_dir, tokenizer_dir=engine.config.model.tokenizer or model_dir,
                                    max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
                                    eos_token_ids=tuple(engine.eos_token_ids),
                                    default_sampling=default_sampling(model_dir))
        if engine.tokenizer is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.model_info.tokenizer_dir)
        self._snapshot(engine, force=True)
        self._ready.set()
        self._loop.call_soon_threadsafe(_resolve, self._loaded, None)
        return engine

    def _loop_forever(self, engine: LLMEngine) -> None:
        while not self._stopping.is_set():
            self._drain_commands(engine, block=not engine.has_unfinished_requests())
            if self._stopping.is_set():
                break
            if engine.has_unfinished_requests():
                start = time.monotonic()
                outputs = engine.step()
                times = StepTimes(start, time.monotonic())
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs, times)
            self._snapshot(engine, force=not engine.has_unfinished_requests())

    def _drain_commands(self, engine: LLMEngine, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._execute(engine, command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _execute(engine: LLMEngine, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, arrival, done = command
            _run_into(done, engine.add_request, request_id, prompt, params, arrival)
        elif kind == "abort":
            engine.abort_request(command[1])
        elif kind == "call":
            _, fn, done = command
            _run_into(done, fn, engine)

    def _snapshot(self, engine: LLMEngine, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._stats_time >= STATS_INTERVAL_S:
            self._stats, self._stats_time = engine.stats(), now

    # -- back on the event loop -------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput], times: StepTimes) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted meanwhile; the engine drops it on the next command drain
            if self.observer is not None:
                self.observer(stream, output, times)
            stream.scheduled = True
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]

    def _die(self, exc: BaseException) -> None:
        self.error = exc
        self._reject_pending(EngineDeadError(f"the engine failed: {exc!r}"))
        if self._loop is None or self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"the engine failed: {exc!r}"))
        self._loop.call_soon_threadsafe(_reject, self._loaded, exc)

    def _reject_pending(self, error: BaseException) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] in ("add", "call") and command[-1].set_running_or_notify_cancel():
                command[-1].set_exception(error)

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


SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def default_sampling(model_dir: str) -> dict:
    """The model's own sampling defaults, as vLLM applies them (``--generation-config auto``)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    return {k: config[k] for k in SAMPLING_DEFAULT_KEYS if config.get(k) is not None}


def _warm_up(engine: LLMEngine) -> None:
    """One real forward pass, so /ready means the model has run."""
    token = engine.eos_token_ids[0] if engine.eos_token_ids else 0
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request(WARMUP_REQUEST_ID, {"prompt_token_ids": [token]}, params)
    for _ in range(100):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    engine.abort_request(WARMUP_REQUEST_ID)


def _run_into(done: concurrent.futures.Future, fn: Callable, *args) -> None:
    if not done.set_running_or_notify_cancel():
        return
    try:
        done.set_result(fn(*args))
    except Exception as exc:  # noqa: BLE001 (handed to the caller)
        done.set_exception(exc)


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _reject(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
        future.exception()  # NOTE: marks it retrieved, so an unawaited failure is not logged twice
