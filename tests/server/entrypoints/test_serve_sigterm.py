"""SIGTERM during streaming: in-flight streams complete, new requests get 503, the process exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import pytest
from api_factories import serve_command, serve_process

from tests.support import free_port

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 900


class Streamer(threading.Thread):
    """One streaming completion, read to the end in a thread."""

    def __init__(self, url: str, i: int) -> None:
        super().__init__(daemon=True)
        self.url, self.i = url, i
        self.chunks: list[dict] = []
        self.done = False
        self.started = threading.Event()

    def run(self) -> None:
        body = {
            "model": "tiny",
            "prompt": f"stream {self.i}",
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.done = True
                    return
                self.chunks.append(json.loads(line[len("data: ") :]))
                self.started.set()


def start_streams(url: str, n: int) -> list[Streamer]:
    streams = [Streamer(url, i) for i in range(n)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60), "a stream did not start"
    return streams


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_drains_in_flight_streams_then_exits_0(tiny_llama, sig):
    with serve_process(tiny_llama, "--drain-timeout", "120") as (proc, url):
        streams = start_streams(url, 4)
        proc.send_signal(sig)
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/ready").status_code == 200:
            assert time.monotonic() < deadline, "/ready stayed 200 after SIGTERM"
            time.sleep(0.01)
        response = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "late", "max_tokens": 2})
        assert response.status_code == 503 and response.headers["Retry-After"]
        assert "shutting down" in response.json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 200
        assert any(s.is_alive() for s in streams), "streams ended before the drain could be observed"
        for s in streams:
            s.join(timeout=120)
            assert s.done, f"stream {s.i} was cut"
            assert s.chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
            assert [c["choices"][0]["finish_reason"] for c in s.chunks if c["choices"]][-1] == "length"
        assert proc.wait(timeout=60) == 0, proc.stdout.read()
        assert "Traceback" not in proc.stdout.read()


def test_drain_timeout_aborts_what_is_left_and_still_exits_0(tiny_llama):
    with serve_process(tiny_llama, "--drain-timeout", "0.5", "--max-num-seqs", "2") as (proc, url):
        streams = start_streams(url, 2)
        proc.send_signal(signal.SIGTERM)
        for s in streams:
            s.join(timeout=60)
            assert s.done  # the stream ends properly, with an error event before [DONE]
            assert "error" in s.chunks[-1] and s.chunks[-1]["error"]["code"] == 503
        assert proc.wait(timeout=60) == 0, proc.stdout.read()


def test_a_value_the_engine_refuses_at_load_fails_start_up_naming_the_flag(tiny_llama):
    cmd = [
        *serve_command(tiny_llama, free_port()),
        "--max-model-len",
        "5000",
        "--log-level",
        "warning",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2
    assert "--max-model-len=5000" in done.stderr, done.stderr
