"""The engine core in its own process: the in-process outputs, loud failure when it dies, no life after the server."""

from __future__ import annotations

import asyncio
import dataclasses
import operator
import os
import signal
import threading
import time

import httpx
import pytest
from api_factories import MODEL_NAME, engine_config, live_server, serve_process

from pagedllm.server import SamplingParams
from pagedllm.server.config import ConfigError
from pagedllm.server.engine.async_engine import AsyncLLMEngine
from pagedllm.server.engine.core_client import MultiprocessAsyncEngine
from pagedllm.server.engine.request_stream import EngineDeadError
from pagedllm.server.entrypoints.openai.settings import ServerSettings

pytestmark = pytest.mark.timeout(300)
PROCESS = ServerSettings(served_model_names=[MODEL_NAME], engine_core="process")
STOP_PROMPT = "the quick brown fox"
REQUESTS = {
    "greedy-logprobs": ("hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)),
    "stop": (STOP_PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),  # stop: set by the test
    "n": ("abc", SamplingParams(n=3, best_of=4, temperature=1.0, seed=3, max_tokens=8, logprobs=1, ignore_eos=True)),
    "beam": ("xyz", SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0, max_tokens=8)),
    "prompt-logprobs": ("hi there", SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1, ignore_eos=True)),
}


def engine_pid(engine) -> int:
    """Runs on the engine's side (picklable by reference)."""
    return os.getpid()


def run(coro, timeout: float = 240.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def final_outputs(engine: AsyncLLMEngine) -> tuple[dict, str]:
    """The outputs of ``REQUESTS``, after a first request that picks the stop string and fills the prefix cache."""
    whole = [o async for o in engine.generate({"prompt": STOP_PROMPT}, REQUESTS["stop"][1], "no-stop")][-1]
    stop = whole.outputs[0].text[5:7]  # NOTE: a stop string the greedy text reaches mid-way
    requests = dict(REQUESTS, stop=(STOP_PROMPT, dataclasses.replace(REQUESTS["stop"][1], stop=[stop])))

    async def last(request_id: str, prompt: str, params: SamplingParams):
        return [o async for o in engine.generate({"prompt": prompt}, params, request_id)][-1]

    # NOTE: one at a time: which requests share a step changes logits in their last bits, and cache hits
    return {rid: await last(rid, p, params) for rid, (p, params) in requests.items()}, stop


def test_the_core_runs_in_its_own_process_and_gives_the_in_process_outputs(tiny_llama):
    config = engine_config(tiny_llama)

    async def in_process() -> tuple[dict, str]:
        engine = AsyncLLMEngine(config)
        engine.start()
        await engine.wait_until_ready(120)
        try:
            return await final_outputs(engine)
        finally:
            await engine.shutdown()

    async def in_core_process() -> tuple[tuple[dict, str], int]:
        engine = MultiprocessAsyncEngine(config)
        engine.start()
        await engine.wait_until_ready(120)
        try:
            pid = await engine.call(engine_pid)
            assert engine.process is not None and pid == engine.process.pid != os.getpid()
            with pytest.raises(ConfigError) as bad:  # the core's validation error reaches the caller as it was
                await engine.add_request("bad", {"prompt_token_ids": [10**6]}, SamplingParams(max_tokens=2))
            outputs = await final_outputs(engine)
            stats = await engine.call(operator.methodcaller("stats"))
            assert stats.blocks_used == 0 and stats.num_running == 0
            assert bad.value.field == "prompt_token_ids"
            return outputs, engine.num_unfinished
        finally:
            await engine.shutdown()
            assert engine.process is not None and not engine.process.is_alive()

    expected, stop = run(in_process())
    (got, got_stop), unfinished = run(in_core_process())
    assert got_stop == stop
    assert unfinished == 0
    for name in REQUESTS:
        assert got[name] == expected[name], name
    stopped = expected["stop"].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop and stop not in stopped.text


def test_killing_the_core_fails_streams_and_health(tiny_llama):
    long = dict(max_model_len=1024)  # NOTE: a stream long enough to be cut mid-way
    with live_server(tiny_llama, PROCESS, **long) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        engine = server.engine
        assert isinstance(engine, MultiprocessAsyncEngine) and engine.process.pid != os.getpid()
        assert http.get("/health").status_code == 200
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        events: list[str] = []
        started = threading.Event()

        def consume() -> None:
            with http.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    events.append(line)
                    started.set()

        reader = threading.Thread(target=consume)
        reader.start()
        assert started.wait(60), "the stream never started"
        os.kill(engine.process.pid, signal.SIGKILL)
        reader.join(30)
        assert not reader.is_alive(), "the stream hung after its engine died"
        text = "\n".join(events)
        assert "service_unavailable" in text and "exited" in text, text[-500:]
        health = http.get("/health")
        assert health.status_code == 503 and "engine" in health.json()["error"]["message"]
        response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 503


def child_pids(server_pid: int) -> list[int]:
    """The server's child processes (the engine core, and multiprocessing's resource tracker)."""
    pids: list[int] = []
    for task in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    return pids


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_the_core_does_not_outlive_the_server(tiny_llama, how):
    with serve_process(tiny_llama, "--engine-core", "process") as (proc, url):
        children = {pid: cmdline(pid) for pid in child_pids(proc.pid)}
        assert any("spawn_main" in name for name in children.values()), children
        with httpx.Client(base_url=url, timeout=60) as http:
            body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200
        proc.send_signal(how)
        code = proc.wait(timeout=60)
        assert code == (0 if how == signal.SIGTERM else -signal.SIGKILL)
        for pid, name in children.items():
            assert wait_gone(pid, 10), f"{name} outlived its server"


def test_a_dead_core_fails_pending_calls(tiny_llama):
    async def scenario() -> None:
        engine = MultiprocessAsyncEngine(engine_config(tiny_llama))
        engine.start()
        await engine.wait_until_ready(120)
        try:
            os.kill(engine.process.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while engine.error is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert isinstance(engine.error, EngineDeadError) and not engine.is_alive
            with pytest.raises(EngineDeadError):
                await engine.add_request("late", {"prompt": "hi"}, SamplingParams(max_tokens=2))
            with pytest.raises(EngineDeadError):
                await engine.call(engine_pid)
        finally:
            await engine.shutdown()

    run(scenario())


def test_tensor_parallel_ranks_hang_off_the_core_and_go_with_it(tiny_llama):
    config = engine_config(tiny_llama, tensor_parallel_size=2, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def tokens(engine: AsyncLLMEngine) -> tuple[list[int], list[int]]:
        engine.start()
        await engine.wait_until_ready(180)
        try:
            last = [o async for o in engine.generate({"prompt": "hello"}, params, "tp")][-1]
            core = getattr(engine, "process", None)
            ranks = child_pids(core.pid) if core is not None else []
            if core is not None:
                os.kill(core.pid, signal.SIGKILL)
            return last.outputs[0].token_ids, ranks
        finally:
            await engine.shutdown()

    expected, _ = run(tokens(AsyncLLMEngine(config)))
    got, ranks = run(tokens(MultiprocessAsyncEngine(config)))
    assert got == expected
    assert ranks, "the second rank is a child of the engine core"
    for pid in ranks:
        assert wait_gone(pid, 15), f"rank {pid} outlived its engine core"
