"""Factories for the HTTP API tests: a live uvicorn server on loopback, in a thread."""

from __future__ import annotations

import contextlib
import operator
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn

from pagedllm.server.config import EngineConfig
from pagedllm.server.entrypoints.openai.api_server import ServerSettings, build_app
from tests.support import free_port

API_KEY = "test-key-123"
MODEL_NAME = "tiny"
# A template for the tiny byte-level test models, which ship none.
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# NOTE: block_size is given: the prefix-cache tests count cached tokens in blocks of 16, and
# the CPU's default of 64 would leave the short prompts of a 96-token model without a full block
ENGINE_ARGS = dict(
    max_model_len=96,
    block_size=16,
    num_gpu_blocks_override=1024,
    max_num_seqs=64,
    swap_space=0.01,
    kv_cache_memory=0.05,
)
READY_TIMEOUT_S = 180


def engine_config(model_dir: str, **overrides) -> EngineConfig:
    return EngineConfig.from_kwargs(model=model_dir, **{**ENGINE_ARGS, **overrides})


class LiveServer:
    """``build_app(config, settings)`` served by uvicorn on 127.0.0.1 in a background thread."""

    def __init__(self, config: EngineConfig, settings: ServerSettings) -> None:
        self.app = build_app(config, settings)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def engine(self):
        return self.app.state.engine

    @property
    def serving(self):
        return self.app.state.serving

    def start(self) -> LiveServer:
        self.thread.start()
        wait_ready(self.url)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def stats(self, timeout: float = 10.0):
        """The engine's stats, taken on the engine thread between steps."""
        return self.engine.submit(operator.methodcaller("stats")).result(timeout)


def wait_ready(url: str, timeout: float = READY_TIMEOUT_S, proc: subprocess.Popen | None = None) -> None:
    """Wait for ``/ready``; a server process that exits first fails at once with its output."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            output = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready:\n{output[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{url} was not ready within {timeout}s")


@contextlib.contextmanager
def live_server(model_dir: str, settings: ServerSettings | None = None, **engine_overrides) -> Iterator[LiveServer]:
    settings = settings or ServerSettings(served_model_names=[MODEL_NAME], api_key=API_KEY, chat_template=CHAT_TEMPLATE)
    server = LiveServer(engine_config(model_dir, **engine_overrides), settings).start()
    try:
        yield server
    finally:
        server.stop()


def wait_until_idle(server: LiveServer, timeout: float = 30.0):
    """Poll until nothing runs or waits and every device block is free; return the last stats."""
    deadline = time.monotonic() + timeout
    stats = server.stats()
    while time.monotonic() < deadline:
        stats = server.stats()
        if (
            stats.num_running == stats.num_waiting == stats.num_swapped == 0
            and stats.blocks_used == 0
            and stats.num_free_gpu_blocks == stats.num_gpu_blocks
        ):
            return stats
        time.sleep(0.05)
    return stats


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent event stream."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]


def serve_command(model_dir: str, port: int) -> list[str]:
    """``pagedllm serve`` of ``model_dir`` on 127.0.0.1:``port``, through this interpreter."""
    return [
        sys.executable,
        "-m",
        "pagedllm.server.entrypoints.cli",
        "serve",
        "--model",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


@contextlib.contextmanager
def serve_process(model_dir: str, *extra: str, env: dict[str, str] | None = None):
    """``pagedllm serve`` on a tiny model in a subprocess on loopback: yields (process, url)."""
    port = free_port()
    cmd = [
        *serve_command(model_dir, port),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "0.05",
        "--swap-space",
        "0.01",
        "--log-level",
        "warning",
        *extra,
    ]
    environment = {k: v for k, v in os.environ.items() if k != "PAGEDLLM_API_KEY"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**environment, **(env or {})}
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc=proc)
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
