"""The async engine with its core in another process: the API server's side of the ZMQ channel.

::

    event loop (HTTP)                 receiver thread                 engine-core process
    ─────────────────                 ───────────────                 ───────────────────
    add_request / abort / call ──────────── PUSH ipc://…/in ─────────► between steps
    RequestStream ◄─ call_soon_threadsafe ◄─ deltas → RequestOutput ◄─ PULL ipc://…/out

Same public surface as :class:`AsyncLLMEngine` (the serving code does not know which it
has); differences: ``call``/``submit`` take a picklable callable (``operator.methodcaller``,
a module-level function), and the engine's model runs in a process of its own, so the
HTTP server's tokenization, detokenization of outputs into responses and SSE no longer
take turns with the model on one interpreter lock.

NOTE: a dead engine-core process (killed, crashed, or a fatal engine error) is noticed by
the receiver thread: ``error`` is set (``/health`` answers 503), every stream and pending
call fails with :class:`EngineDeadError`, and nothing waits forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import zmq

from pagedllm.server.config import EngineConfig
from pagedllm.server.engine import core_messages as msg
from pagedllm.server.engine.async_engine import AsyncLLMEngine
from pagedllm.server.engine.commands import AbortRequests, AddRequest, CallEngine, Command, awaitable_error
from pagedllm.server.engine.core_process import CoreAddresses, run_engine_core
from pagedllm.server.engine.model_info import load_tokenizer
from pagedllm.server.engine.output_deltas import OutputAccumulator
from pagedllm.server.engine.request_stream import EngineDeadError, StepTimes
from pagedllm.server.outputs import EngineOutput

logger = logging.getLogger("pagedllm.async_engine")

RECEIVE_POLL_MS = 100
STOP_GRACE_S = 10.0


class MultiprocessAsyncEngine(AsyncLLMEngine):
    """:class:`AsyncLLMEngine` whose :class:`LLMEngine` runs in an engine-core process."""

    def __init__(
        self, config: EngineConfig, *, warmup: bool = True, observer: Callable[..., None] | None = None
    ) -> None:
        super().__init__(config, warmup=warmup, observer=observer)
        self.process: multiprocessing.process.BaseProcess | None = None
        """The engine-core process, once started."""
        self._zmq: zmq.Context | None = None
        self._inputs: zmq.Socket | None = None
        self._outputs: zmq.Socket | None = None
        self._dir = ""
        self._send_lock = threading.Lock()
        self._call_ids = itertools.count()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._pending_lock = threading.Lock()
        self._accumulator = OutputAccumulator()
        self._forgotten: queue.SimpleQueue[str] = queue.SimpleQueue()

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine-core process (it loads the model) and the thread that receives its messages."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loaded = self._loop.create_future()
        self._dir = tempfile.mkdtemp(prefix="pagedllm-core-")
        addresses = CoreAddresses(f"ipc://{self._dir}/in", f"ipc://{self._dir}/out")
        self._zmq = zmq.Context()
        self._inputs = _bound(self._zmq, zmq.PUSH, addresses.inputs)
        self._outputs = _bound(self._zmq, zmq.PULL, addresses.outputs)
        # NOTE: spawn, not fork: the API server may already hold threads and an initialised torch.
        context = multiprocessing.get_context("spawn")
        self.process = context.Process(
            target=run_engine_core,
            args=(self.config, addresses, self._warmup, os.getpid(), logging.getLogger().getEffectiveLevel()),
            name="pagedllm-engine-core",
        )
        self.process.start()
        self._thread = threading.Thread(target=self._run, name="pagedllm-core-receiver", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return super().is_alive and self.process is not None and self.process.is_alive()

    async def shutdown(self, timeout: float = STOP_GRACE_S) -> None:
        """Stop the engine-core process (SHUTDOWN, then SIGKILL past ``timeout``); streams end with an error."""
        self._stopping.set()
        if self.process is not None and self.process.is_alive():
            self._post(msg.SHUTDOWN, b"")
        loop = asyncio.get_running_loop()
        if self.process is not None:
            await loop.run_in_executor(None, self._stop_process, timeout)
        if self._thread is not None:
            await loop.run_in_executor(None, self._thread.join, timeout)
        dead = EngineDeadError("the server is shutting down")
        self._reject_pending(dead)
        self._fail_all(dead)
        if self._zmq is not None:
            with self._send_lock:
                for socket in (self._inputs, self._outputs):
                    if socket is not None:
                        socket.close(linger=0)
            self._zmq.term()
            self._zmq = None
            shutil.rmtree(self._dir, ignore_errors=True)

    def _stop_process(self, timeout: float) -> None:
        assert self.process is not None
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("the engine core did not stop within %.0fs: killing it", timeout)
            self.process.kill()
            self.process.join()

    # -- commands to the engine core --------------------------------------------------------
    def _send(self, command: Command) -> None:
        if isinstance(command, AddRequest):
            request = (command.request_id, command.prompt, command.params, command.arrival_time, command.lora_request)
            self._post_call(msg.ADD, command.done, request)
        elif isinstance(command, AbortRequests):
            for request_id in command.request_ids:
                self._forgotten.put(request_id)
            self._post(msg.ABORT, msg.encode(command.request_ids))
        elif isinstance(command, CallEngine):
            self._post_call(msg.CALL, command.done, command.fn)

    def _post_call(self, tag: bytes, done: concurrent.futures.Future, payload: Any) -> None:
        """Send a command that answers (REPLY); ``done`` gets the answer."""
        if not self.is_alive:
            done.set_exception(EngineDeadError(self.not_ready_reason()))
            return
        call_id = next(self._call_ids)
        try:
            body = msg.dumps((call_id, payload))
        except Exception as exc:  # noqa: BLE001 (e.g. a lambda: the caller learns why)
            done.set_exception(TypeError(f"cannot send this to the engine-core process: {exc!r}"))
            return
        with self._pending_lock:
            self._pending[call_id] = done
        if not self._post(tag, body):
            with self._pending_lock:
                self._pending.pop(call_id, None)
            done.set_exception(EngineDeadError(self.not_ready_reason()))

    def _post(self, tag: bytes, body: bytes) -> bool:
        """Send without waiting; False when no engine core is connected (it stopped or died)."""
        with self._send_lock:
            if self._inputs is None or self._inputs.closed:  # NOTE: aborts may follow a shutdown
                return False
            try:
                self._inputs.send_multipart([tag, body], zmq.NOBLOCK)
            except zmq.Again:
                return False
            return True

    def _reject_pending(self, error: BaseException) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for done in pending.values():
            if not done.done():
                done.set_exception(error)

    # -- the receiver thread ----------------------------------------------------------------
    def _run(self) -> None:
        assert self._outputs is not None
        try:
            while not self._stopping.is_set():
                if self._outputs.poll(RECEIVE_POLL_MS):
                    self._receive(*self._outputs.recv_multipart())
                elif self.process is not None and not self.process.is_alive():
                    self._lost(f"the engine-core process exited with code {self.process.exitcode}")
                    return
        except _CoreDied:
            return
        except BaseException as exc:  # noqa: BLE001 (a bug here must not leave requests hanging)
            logger.exception("the engine-core receiver failed")
            self._die(exc)

    def _receive(self, tag: bytes, body: bytes) -> None:
        if tag == msg.OUTPUTS:
            self._on_outputs(msg.decode_outputs(body))
        elif tag == msg.REPLY:
            self._on_reply(*msg.loads(body))
        elif tag == msg.ABORTED:
            self._accumulator.forget(msg.decode_ids(body))
        elif tag == msg.STATS:
            self._stats.latest = msg.loads(body)
        elif tag == msg.READY:
            self._on_ready(*msg.loads(body))
        elif tag == msg.DEAD:
            error = msg.loads(body)
            logger.error("the engine core %s: %r", "died" if self._ready.is_set() else "failed to start", error)
            self._die(error)
            self._reject_pending(EngineDeadError(f"the engine failed: {error!r}"))
            raise _CoreDied

    def _on_ready(self, model_info: Any, stats: Any) -> None:
        self.model_info, self._stats.latest = model_info, stats
        if not self.config.model.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(model_info.tokenizer_dir)
        self._ready.set()
        assert self._loop is not None and self._loaded is not None
        self._loop.call_soon_threadsafe(_resolve, self._loaded)

    def _on_reply(self, call_id: int, ok: bool, value: Any) -> None:
        with self._pending_lock:
            done = self._pending.pop(call_id, None)
        if done is None or not done.set_running_or_notify_cancel():
            return
        if ok:
            done.set_result(value)
        else:
            done.set_exception(awaitable_error(value))

    def _on_outputs(self, step: msg.StepOutputs) -> None:
        self._drain_forgotten()
        outputs: list[EngineOutput] = []
        for delta in step.deltas:
            output = self._accumulator.add(delta)
            if output is not None:
                outputs.append(output)
        if step.others is not None:
            outputs.extend(msg.loads(step.others))
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, outputs, StepTimes(step.start, step.end))

    def _drain_forgotten(self) -> None:
        ids = []
        while True:
            try:
                ids.append(self._forgotten.get_nowait())
            except queue.Empty:
                break
        if ids:
            self._accumulator.forget(ids)

    def _lost(self, reason: str) -> None:
        logger.error("%s", reason)
        error = EngineDeadError(reason)
        self._die(error)
        self._reject_pending(error)

    def not_ready_reason(self) -> str:
        if self.error is None and self.process is not None and self._thread is not None and not self.is_alive:
            return f"the engine-core process exited with code {self.process.exitcode}"
        return super().not_ready_reason()


def _bound(context: zmq.Context, kind: int, address: str) -> zmq.Socket:
    socket = context.socket(kind)
    # NOTE: no high-water mark: a burst of requests queues rather than failing; a send can then only
    # fail (zmq.Again) when no engine core is connected.
    socket.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)
    socket.bind(address)
    return socket


class _CoreDied(Exception):
    """The engine core said it is dead; the receiver stops."""


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
