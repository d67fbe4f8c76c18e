"""What a person sees: the start-up block, one access line per request, a helpful root, clean metrics."""

from __future__ import annotations

import socket
import subprocess

import httpx
from api_factories import serve_command, serve_process

from tests.support import free_port


def test_start_up_block_access_lines_root_and_metrics(tiny_llama):
    with serve_process(tiny_llama, "--log-level", "info") as (proc, url):
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
        assert (
            httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "look-for-me"}).status_code == 200
        )
        root = httpx.get(url).json()
        assert root["models"] == ["tiny"] and root["endpoints"]["docs"] == "/docs"
        metrics = httpx.get(f"{url}/metrics").text
        assert "_created" not in metrics
        assert 'vllm:num_requests_waiting{model_name="tiny"}' in metrics and "vllm:kv_cache_usage_perc" in metrics
        assert "vllm:cache_config_info{" in metrics and 'vllm:num_requests_running{model_name="tiny"} 0.0' in metrics
        proc.terminate()
        log = proc.communicate(timeout=60)[0]
    assert "KV cache blocks" in log and "max model len" in log and "serving          http://" in log
    assert "look-for-me 200 prompt_tokens=2 output_tokens=3" in log


def test_disable_log_requests(tiny_llama):
    with serve_process(tiny_llama, "--log-level", "info", "--disable-log-requests") as (proc, url):
        httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
            headers={"X-Request-Id": "quiet-one"},
        )
        proc.terminate()
        log = proc.communicate(timeout=60)[0]
    assert "quiet-one" not in log


def test_a_busy_port_fails_before_the_model_loads(tiny_llama):
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        cmd = [
            *serve_command("/does/not/matter", port),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"--port={port} is already in use" in done.stderr, done.stderr
