"""Limits a shared endpoint needs: waiting queue, request time, body size, stop strings, tenant salts."""

from __future__ import annotations

import json

import httpx
import pytest
from api_factories import MODEL_NAME, live_server, wait_until_idle

from pagedllm.server.entrypoints.openai.settings import ServerSettings

LONG = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 90, "ignore_eos": True}


def settings(**overrides) -> ServerSettings:
    return ServerSettings(served_model_names=[MODEL_NAME], **overrides)


@pytest.fixture(scope="module")
def limited(tiny_llama_dirs):
    with live_server(tiny_llama_dirs["gqa"], settings(max_body_bytes=4096)) as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            yield server, http


def test_the_waiting_queue_defaults_to_four_times_max_num_seqs(limited):
    server, _ = limited
    assert server.serving.max_queue_len == 4 * server.engine.config.scheduler.max_num_seqs


def test_a_request_past_its_timeout_is_aborted(tiny_llama):
    # NOTE: 90 decode steps cannot finish in 10 ms; the limit is meant to be hit.
    with live_server(tiny_llama, settings(request_timeout=0.01)) as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            response = http.post("/v1/completions", json=LONG)
            assert response.status_code == 504, response.text
            error = response.json()["error"]
            assert error["type"] == "timeout_error" and "--request-timeout=0.01s" in error["message"]
            stream = http.post("/v1/completions", json={**LONG, "stream": True})
            events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "timeout_error"
            stats = wait_until_idle(server)
            assert stats.blocks_used == 0 and stats.num_free_gpu_blocks == stats.num_gpu_blocks


def test_a_body_over_the_limit_gets_413(limited):
    _, http = limited
    big = {"model": MODEL_NAME, "prompt": "x" * 5000, "max_tokens": 1}
    response = http.post("/v1/completions", json=big)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunked():
        yield json.dumps(big).encode()

    response = http.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413, response.text
    assert http.post("/v1/completions", json={**big, "prompt": "x"}).status_code == 200


@pytest.mark.parametrize("stop, text", [(["s"] * 33, "33 strings"), (["x" * 600], "600 characters")])
def test_stop_strings_are_capped(limited, stop, text):
    _, http = limited
    response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "a", "max_tokens": 1, "stop": stop})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stop"
    assert text in response.json()["error"]["message"]


def test_a_request_id_header_names_the_request(limited):
    _, http = limited
    body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 1}
    response = http.post("/v1/completions", json=body, headers={"X-Request-Id": "abc-123"})
    assert response.json()["id"] == "abc-123"
    response = http.post("/v1/completions", json=body, headers={"X-Request-Id": "x" * 200})
    assert response.status_code == 400 and response.json()["error"]["param"] == "X-Request-Id"


# -- tenant salts ----------------------------------------------------------------------------------------
def prefix_hits(server, http, headers=None, **extra) -> int:
    before = server.stats().prefix_cache_hits
    body = {"model": MODEL_NAME, "prompt": list(range(1, 50)), "max_tokens": 1, **extra}
    response = http.post("/v1/completions", json=body, headers=headers or {})
    assert response.status_code == 200, response.text
    return server.stats().prefix_cache_hits - before


def test_required_salt(tiny_llama):
    with live_server(tiny_llama, settings(cache_salt_policy="required")) as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"
            assert prefix_hits(server, http, cache_salt="t1") == 0
            assert prefix_hits(server, http, cache_salt="t1") > 0
            assert prefix_hits(server, http, cache_salt="t2") == 0


def test_salt_derived_from_the_api_key(tiny_llama):
    with live_server(tiny_llama, settings(cache_salt_policy="api-key")) as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
            assert prefix_hits(server, http, alice) == 0
            assert prefix_hits(server, http, alice) > 0
            assert prefix_hits(server, http, bob) == 0
            assert prefix_hits(server, http, bob, cache_salt="x") == 0  # a tenant's own salts nest inside its key
