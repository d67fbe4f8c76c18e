"""The Dockerfile agrees with what the operator renders (it cannot be built here)."""

from __future__ import annotations

import json
import re

import pytest
from helm_tools import ROOT

from pagedllm.operator.command import SERVE_COMMAND
from pagedllm.operator.manifests import FETCH_SCRIPT, RUN_AS, RenderConfig, render
from pagedllm.operator.spec import PagedLLMSpec

DOCKERFILE = ROOT / "Dockerfile"


def final_stage() -> list[str]:
    """Instructions of the last stage (the image that is built by default), continuations joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    starts = [i for i, line in enumerate(lines) if line.upper().startswith("FROM ")]
    return lines[starts[-1] :]


def instruction(name: str) -> list[str]:
    return [line.split(None, 1)[1] for line in final_stage() if line.split(None, 1)[0].upper() == name]


def rendered_server() -> dict:
    body = {"metadata": {"name": "m", "namespace": "n", "uid": "u"}, "spec": {"model": "org/model"}}
    return render(body, RenderConfig(default_image="img")).deployment["spec"]["template"]["spec"]


def test_entrypoint_is_the_rendered_server_command():
    (entrypoint,) = instruction("ENTRYPOINT")
    assert json.loads(entrypoint) == list(SERVE_COMMAND)
    (container,) = rendered_server()["containers"]
    assert container["command"] == json.loads(entrypoint)


def test_runs_as_the_non_root_user_the_pods_expect():
    (user,) = instruction("USER")
    assert user.split(":")[0] == str(RUN_AS) != "0"
    assert rendered_server()["securityContext"]["runAsUser"] == RUN_AS


def test_exposes_the_default_port():
    assert instruction("EXPOSE") == [str(PagedLLMSpec(model="m").port)]


def test_the_image_has_what_the_init_container_runs():
    # fetch-model runs `python -c FETCH_SCRIPT`: the venv's python on PATH, huggingface_hub in it.
    (fetch,) = rendered_server()["initContainers"]
    assert fetch["command"][:3] == ["python", "-c", FETCH_SCRIPT]
    env = " ".join(instruction("ENV"))
    assert "PATH=/opt/venv/bin:" in env
    assert "from huggingface_hub import snapshot_download" in FETCH_SCRIPT


def test_cuda_runtime_base_and_the_package_with_extras():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM nvidia/cuda:\$\{CUDA_VERSION\}-runtime-", text, re.M)
    assert 'pip install "/src[triton,operator]"' in text
    for folder in ("server", "kernels", "operator"):
        assert f"COPY {folder} /src/{folder}" in text


@pytest.mark.parametrize("path", ["pyproject.toml", "README.md", "server/", "kernels/", "operator/"])
def test_dockerignore_lets_the_sources_in(path):
    allowed = [line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")]
    assert path in allowed
