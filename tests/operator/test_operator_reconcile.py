"""One reconcile per owner, against the emulated cluster: events only trigger it, and it writes only changes."""

from __future__ import annotations

import pytest
from emulated_scenario import condition, pagedllm

pytestmark = pytest.mark.k8s


def status_writes(cluster, namespace: str) -> int:
    path = f"/apis/pagedllm.dev/v1alpha1/namespaces/{namespace}/pagedllms/llama/status"
    return sum(1 for r in cluster.operator_requests() if r.method.value == "PATCH" and r.url.path == path)


def test_a_child_event_that_changes_nothing_writes_no_status(scenario, cluster):
    scenario.api.create(pagedllm(scenario.ns))
    dep = scenario.wait_deployment()
    ready = {"observedGeneration": dep["metadata"]["generation"], "replicas": 1, "updatedReplicas": 1}
    scenario.api.patch("Deployment", scenario.ns, "llama", {"status": {**ready, "readyReplicas": 1}}, sub="status")
    scenario.wait_status(lambda s, o: s.get("phase") == "Ready", "Ready")
    before = status_writes(cluster, scenario.ns)

    # An event the status does not show (a label someone added), then one it does.
    scenario.api.patch("Deployment", scenario.ns, "llama", {"metadata": {"labels": {"team": "ml"}}})
    scenario.api.patch("Deployment", scenario.ns, "llama", {"status": {"readyReplicas": 0}}, sub="status")
    obj = scenario.wait_status(lambda s, o: s.get("phase") == "Pending", "Pending again")
    assert condition(obj, "Ready")["status"] == "False"
    assert status_writes(cluster, scenario.ns) == before + 1
    assert scenario.get("Deployment")["metadata"]["labels"]["team"] == "ml"  # not drift: the operator never set it
