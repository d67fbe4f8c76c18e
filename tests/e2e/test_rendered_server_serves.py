"""What the operator writes actually serves: run a rendered Deployment's container command
locally on a CPU-sized model, wait for its readiness probe, and complete a request."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from pagedllm.operator.command import SERVE_COMMAND
from pagedllm.operator.manifests import RenderConfig, render
from pagedllm.server.demo import ensure_demo_model
from tests.support import free_port


def rendered_container(model_dir: str, port: int, tensor_parallel_size: int = 1) -> dict:
    body = {
        "apiVersion": "pagedllm.dev/v1alpha1",
        "kind": "PagedLLM",
        "metadata": {"name": "demo", "namespace": "ml", "uid": "0f6c9a1e-1111-4222-8333-444455556666", "generation": 1},
        "spec": {
            "model": model_dir,
            "port": port,
            "blockSize": 8,
            "maxModelLen": 512,
            "maxNumSeqs": 8,
            "servedModelName": "demo",
            "drainTimeoutSeconds": 5,
            "tensorParallelSize": tensor_parallel_size,
        },
    }
    deployment = render(body, RenderConfig(default_image="pagedllm:test")).deployment
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode} before becoming ready"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not ready within {timeout}s")


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_rendered_command_serves_a_completion(tensor_parallel_size):
    port = free_port()
    container = rendered_container(ensure_demo_model(), port, tensor_parallel_size)
    resources = container["resources"]["limits"]
    assert resources.get("nvidia.com/gpu") in (tensor_parallel_size, str(tensor_parallel_size))
    assert ["--tensor-parallel-size", str(tensor_parallel_size)] == container["args"][
        container["args"].index("--tensor-parallel-size") : container["args"].index("--tensor-parallel-size") + 2
    ]
    assert tuple(container["command"]) == SERVE_COMMAND
    assert not any("valueFrom" in e for e in container.get("env", []))  # nothing needs a cluster here
    script = shutil.which("pagedllm", path=os.path.dirname(sys.executable))
    assert script, "the pagedllm console script is not installed next to this interpreter"
    env = {**os.environ, **{e["name"]: e["value"] for e in container.get("env", [])}, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [script, *container["command"][1:], *container["args"]],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        probe = container["readinessProbe"]["httpGet"]["path"]
        wait_ready(f"http://127.0.0.1:{port}{probe}", proc, timeout=180)
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={"model": "demo", "prompt": "The for statement", "max_tokens": 8, "temperature": 0},
        )
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"] and response.json()["usage"]["completion_tokens"] > 0
        assert httpx.get(f"http://127.0.0.1:{port}" + container["livenessProbe"]["httpGet"]["path"]).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"server did not exit after SIGTERM:\n{proc.communicate()[0][-2000:]}")
    assert code == 0, proc.communicate()[0][-2000:]
