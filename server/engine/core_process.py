"""The engine-core process: scheduler, block manager, model runner and sampler, fed over ZMQ.

::

    API server process                    engine-core process (this module)
    ──────────────────                    ─────────────────────────────────
    PUSH  ipc://…/in   ── ADD/ABORT/CALL ──► PULL: drained between steps
    PULL  ipc://…/out  ◄── OUTPUTS (deltas) ── PUSH: one message per step

Tensor-parallel ranks are this process's children. The process exits when its parent
does (it polls its parent's pid), so a server that dies leaves no engine behind; and when
the engine fails it says so (DEAD) before it exits, so waiting requests fail at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from pagedllm.server.config import EngineConfig
from pagedllm.server.engine import core_messages as msg
from pagedllm.server.engine.commands import ArrivalWave
from pagedllm.server.engine.output_deltas import DeltaMaker, RequestDelta

if TYPE_CHECKING:
    from pagedllm.server.engine.llm_engine import LLMEngine

logger = logging.getLogger("pagedllm.engine_core")

STATS_INTERVAL_S = 0.05
PARENT_POLL_S = 0.5
IDLE_POLL_MS = 500


@dataclass(frozen=True)
class CoreAddresses:
    """Where the two ZMQ channels live (``ipc://`` paths the API server bound)."""

    inputs: str
    """API server -> engine core: requests, aborts, calls."""
    outputs: str
    """Engine core -> API server: outputs, replies, stats."""


def run_engine_core(
    config: EngineConfig, addresses: CoreAddresses, warmup: bool, parent_pid: int, log_level: int = logging.INFO
) -> None:
    """The process's entry point: build the engine, then serve commands and steps until told to stop.

    ``log_level``: the API server's, so ``--log-level`` holds for both processes.
    """
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _exit_with_parent(parent_pid)
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(addresses.inputs)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(addresses.outputs)
    engine: LLMEngine | None = None
    try:
        from pagedllm.server.engine.llm_engine import LLMEngine  # NOTE: torch loads here, in this process only

        engine = LLMEngine(config)
        if warmup:
            engine.warm_up()
        EngineCore(engine, inputs, outputs).run()
    except BaseException as exc:  # noqa: BLE001 (reported to the API server, which fails its requests)
        logger.exception("the engine core failed" if engine is not None else "the engine core failed to start")
        outputs.send_multipart([msg.DEAD, msg.dumps(msg.portable_error(exc))])
    finally:
        if engine is not None:
            engine.shutdown()
        inputs.close(linger=0)
        outputs.close(linger=1000)  # NOTE: lets a last DEAD message reach the API server
        context.term()


def _exit_with_parent(parent_pid: int) -> None:
    """Exit at once when the API server process is gone (it was killed, or exited without stopping us)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="pagedllm-parent-watch", daemon=True).start()


class EngineCore:
    """The loop: drain commands, run a step, send its deltas; block while there is nothing to run."""

    def __init__(self, engine: LLMEngine, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
        self.engine = engine
        self.inputs = inputs
        self.outputs = outputs
        self.deltas = DeltaMaker()
        engine.request_output = self.deltas
        self._stats_time = 0.0
        self._running = True
        self._wave = ArrivalWave()

    def run(self) -> None:
        self.outputs.send_multipart([msg.READY, msg.dumps((self.engine.model_info, self.engine.stats()))])
        while self._running:
            self._drain(block=not self.engine.has_unfinished_requests())
            if not self._running:
                return
            if self.engine.has_unfinished_requests():
                self._step()
            self._send_stats(force=not self.engine.has_unfinished_requests())
            self.engine.check_health()

    def _step(self) -> None:
        start = time.monotonic()
        results: list[Any] = self.engine.step()  # NOTE: deltas for generations (see __init__), embeddings whole
        end = time.monotonic()
        if not results:
            return
        deltas = [r for r in results if isinstance(r, RequestDelta)]
        self._wave.finished = sum(1 for d in deltas if d.finished)
        others = [r for r in results if not isinstance(r, RequestDelta)]
        body = msg.StepOutputs(start, end, deltas, msg.dumps(others) if others else None)
        self.outputs.send_multipart([msg.OUTPUTS, msg.encode(body)], copy=False)

    def _send_stats(self, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._stats_time >= STATS_INTERVAL_S:
            self._stats_time = now
            self.outputs.send_multipart([msg.STATS, msg.dumps(self.engine.stats())])

    # -- commands --------------------------------------------------------------------------
    def _drain(self, block: bool) -> None:
        """Run the commands waiting; when ``block`` (the engine is idle), wait for the first, and
        after a step that finished several requests, for as many (``commands.ArrivalWave``)."""
        if block and not self.inputs.poll(IDLE_POLL_MS):
            self._wave.idled()
            return
        self._wave.begin(idle=block)
        while True:
            try:
                tag, body = self.inputs.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                wait = self._wave.wait_s()
                if wait <= 0 or not self.inputs.poll(max(1, round(1000 * wait))):
                    return
                continue
            self._wave.took(tag == msg.ADD)
            self._execute(tag, body)

    def _execute(self, tag: bytes, body: bytes) -> None:
        if tag == msg.ADD:
            call_id, request = msg.loads(body)
            self._reply(call_id, self.engine.add_request, *request)
        elif tag == msg.ABORT:
            ids = msg.decode_ids(body)
            self.engine.abort_request(ids)
            self.deltas.forget(ids)
            self.outputs.send_multipart([msg.ABORTED, body])
        elif tag == msg.CALL:
            call_id, fn = msg.loads(body)
            self._reply(call_id, fn, self.engine)
        elif tag == msg.SHUTDOWN:
            self._running = False

    def _reply(self, call_id: int, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)``; its result or exception goes back to the caller, never out of the loop."""
        try:
            answer = (call_id, True, fn(*args))
        except Exception as exc:  # noqa: BLE001 (handed to the caller)
            answer = (call_id, False, msg.portable_error(exc))
        try:
            body = msg.dumps(answer)
        except Exception as exc:  # noqa: BLE001 (an unpicklable result)
            body = msg.dumps((call_id, False, RuntimeError(f"the result cannot be sent back: {exc!r}")))
        self.outputs.send_multipart([msg.REPLY, body])
