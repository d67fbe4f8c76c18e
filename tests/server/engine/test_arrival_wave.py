"""An idle engine whose last step finished several requests waits for as many new ones before it steps.

Both engine loops (the core process's and the in-process thread's) are driven here directly,
with a stand-in engine that records the requests it was given, and the two timing constants
raised so that the assertions hold on a loaded machine.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import zmq

from pagedllm.server import SamplingParams
from pagedllm.server.engine import async_engine, commands, core_process
from pagedllm.server.engine import core_messages as msg
from pagedllm.server.engine.commands import AddRequest, expected_arrivals

GAP_S, WINDOW_S, LATE_S = 0.4, 3.0, 0.15
"""The gap and window the loops run with here, and how late the second request comes."""


class RecordingEngine:
    def __init__(self) -> None:
        self.added: list[str] = []

    def add_request(self, request_id, *_args) -> None:
        self.added.append(request_id)


@pytest.fixture(autouse=True)
def slow_clock(monkeypatch):
    monkeypatch.setattr(commands, "ARRIVAL_GAP_S", GAP_S)
    monkeypatch.setattr(commands, "ARRIVAL_WINDOW_S", WINDOW_S)


def test_only_a_step_that_finished_several_requests_makes_the_engine_wait():
    assert [expected_arrivals(n) for n in (0, 1, 2, 8)] == [0, 0, 2, 8]


class CoreLoop:
    """``EngineCore._drain`` fed over a real ZMQ pipe."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.pull = self.context.socket(zmq.PULL)
        self.pull.bind("inproc://arrivals")
        self.push = self.context.socket(zmq.PUSH)
        self.push.connect("inproc://arrivals")
        self.replies = self.context.socket(zmq.PUSH)
        self.replies.bind("inproc://replies")
        self.sink = self.context.socket(zmq.PULL)  # NOTE: a PUSH with no peer blocks the core's replies
        self.sink.connect("inproc://replies")
        self.engine = RecordingEngine()
        self.core = core_process.EngineCore(self.engine, self.pull, self.replies)  # type: ignore[arg-type]
        self.lock = threading.Lock()

    def send(self, request_id: str) -> None:
        request = (request_id, {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=1), 0.0, None)
        with self.lock:  # NOTE: a ZMQ socket is not for two threads at once
            self.push.send_multipart([msg.ADD, msg.dumps((0, request))])

    def drain(self, finished: int) -> float:
        self.core._wave.finished = finished
        start = time.monotonic()
        self.core._drain(block=True)
        return time.monotonic() - start

    def close(self) -> None:
        for socket in (self.push, self.pull, self.replies, self.sink):
            socket.close(linger=0)
        self.context.term()


class ThreadLoop:
    """``AsyncLLMEngine._drain_commands`` fed through its command queue."""

    def __init__(self) -> None:
        self.engine = RecordingEngine()
        self.loop = async_engine.AsyncLLMEngine(None)  # type: ignore[arg-type]

    def send(self, request_id: str) -> None:
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.loop._commands.put(AddRequest(request_id, {"prompt_token_ids": [1, 2]}, SamplingParams(), 0.0, done))

    def drain(self, finished: int) -> float:
        self.loop._wave.finished = finished
        start = time.monotonic()
        self.loop._drain_commands(self.engine, block=True)  # type: ignore[arg-type]
        return time.monotonic() - start

    def close(self) -> None:
        pass


@pytest.fixture(params=["core-process", "engine-thread"])
def loop(request):
    made = CoreLoop() if request.param == "core-process" else ThreadLoop()
    yield made
    made.close()


def send_later(loop, request_id: str, delay: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay), loop.send(request_id)))
    thread.start()
    return thread


def test_after_a_wave_finished_the_next_wave_is_taken_whole(loop):
    loop.send("a")
    late = send_later(loop, "b", LATE_S)
    took = loop.drain(finished=2)
    late.join()
    assert loop.engine.added == ["a", "b"]
    assert LATE_S <= took < LATE_S + GAP_S  # NOTE: it stepped as soon as the second came, not after a gap


def test_after_one_finished_a_request_is_taken_at_once(loop):
    loop.send("a")
    late = send_later(loop, "b", LATE_S)
    took = loop.drain(finished=1)
    late.join()
    assert loop.engine.added == ["a"] and took < LATE_S
    loop.drain(finished=0)
    assert loop.engine.added == ["a", "b"]


def test_a_wave_that_does_not_come_back_whole_costs_one_gap(loop):
    loop.send("a")
    took = loop.drain(finished=3)
    assert loop.engine.added == ["a"]
    assert GAP_S * 0.9 <= took < 2 * GAP_S


def test_the_wait_ends_at_the_window(loop, monkeypatch):
    monkeypatch.setattr(commands, "ARRIVAL_WINDOW_S", 0.5)
    loop.send("a")
    threads = [send_later(loop, f"r{i}", 0.15 * i) for i in range(1, 8)]  # each within the gap of the last
    took = loop.drain(finished=8)
    for thread in threads:
        thread.join()
    assert 0.45 <= took < 0.9 and 3 <= len(loop.engine.added) <= 5
    loop.drain(finished=0)
    assert len(loop.engine.added) == 8  # the rest wait for the next drain, none is lost
