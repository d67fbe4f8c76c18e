"""Many concurrent streams with disconnects, and a non-streaming client that goes away."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from api_factories import API_KEY, MODEL_NAME, live_server, wait_until_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
NUM_CLIENTS = 120
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tiny_llama):
    with live_server(tiny_llama) as s:
        yield s


async def stream_one(client: httpx.AsyncClient, i: int, disconnect: bool) -> dict:
    body = {
        "model": MODEL_NAME,
        "prompt": f"client {i} says",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0.5,
        "seed": i,
    }
    chunks = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                return {"done": True, "chunks": chunks}
            chunks.append(json.loads(data))
            if disconnect and len(chunks) == 2:
                return {"done": False, "chunks": chunks}  # leaving the block closes the connection
    return {"done": False, "chunks": chunks}


async def run_clients(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, limits=limits, timeout=120) as client:
        return await asyncio.gather(*(stream_one(client, i, disconnect=i % 3 == 0) for i in range(NUM_CLIENTS)))


@pytest.mark.timeout(240)
def test_concurrent_streams_with_a_third_disconnecting(server):
    aborted_before = _abort_count(server.url)
    results = asyncio.run(run_clients(server.url))
    for i, result in enumerate(results):
        if i % 3 == 0:
            assert not result["done"] and len(result["chunks"]) == 2
            continue
        assert result["done"], f"client {i} did not get [DONE]"
        text_tokens = sum(len(c["choices"][0]["text"]) > 0 for c in result["chunks"])
        assert text_tokens >= 1
        assert result["chunks"][-1]["choices"][0]["finish_reason"] == "length"
    stats = wait_until_idle(server)
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.num_swapped == 0
    assert stats.blocks_used == 0 and stats.num_free_gpu_blocks == stats.num_gpu_blocks
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks
    assert server.engine.num_unfinished == 0
    assert _abort_count(server.url) - aborted_before == NUM_CLIENTS // 3


@pytest.mark.timeout(120)
def test_non_streaming_client_that_disconnects_mid_generation_is_aborted(server):
    body = json.dumps(
        {"model": MODEL_NAME, "prompt": "wait", "max_tokens": 90, "ignore_eos": True, "n": 8, "temperature": 1.0}
    ).encode()
    before = _counter(server.url, "pagedllm:generation_tokens_total")
    aborted = _abort_count(server.url)
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer "
        + API_KEY.encode()
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    _wait_for(lambda: (server.engine.stats().num_running or 0) > 0)
    gate = threading.Event()
    server.engine.submit(lambda engine: gate.wait(30))  # NOTE: holds the engine between two steps
    sock.close()
    try:
        _wait_for(lambda: server.engine.num_unfinished == 0)  # the disconnect was seen; abort is queued
    finally:
        gate.set()
    stats = wait_until_idle(server)
    assert stats.num_running == 0 and stats.blocks_used == 0
    assert _abort_count(server.url) == aborted + 1
    assert _counter(server.url, "pagedllm:generation_tokens_total") - before < 8 * 90


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


def _counter(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return 0.0


def _abort_count(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == "pagedllm:request_success_total" and sample.labels["finished_reason"] == "abort":
                return sample.value
    return 0.0
