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


def child_writes(cluster, namespace: str) -> list[str]:
    """The operator's writes of the children (not of the resource's status), as "METHOD PATH"."""
    return [
        f"{r.method.value} {r.url.path}"
        for r in cluster.operator_requests()
        if r.method.value in ("POST", "PATCH", "PUT", "DELETE")
        and f"/namespaces/{namespace}/" in r.url.path
        and "/pagedllms/" not in r.url.path
        and "/events" not in r.url.path
    ]


def test_a_second_reconcile_against_defaulted_children_changes_nothing(scenario, cluster):
    scenario.api.create(pagedllm(scenario.ns, replicas=2))
    dep = scenario.wait_deployment()
    # The live children carry what the API server defaults and the rendering leaves out.
    (server,) = dep["spec"]["template"]["spec"]["containers"]
    assert server["terminationMessagePath"] == "/dev/termination-log" and dep["spec"]["strategy"]["type"]
    assert dep["spec"]["template"]["spec"]["dnsPolicy"] == "ClusterFirst"
    service = scenario.wait(lambda: scenario.get("Service"), "the Service")
    assert service["spec"]["sessionAffinity"] == "None" and service["spec"]["clusterIP"]
    ready = {"observedGeneration": dep["metadata"]["generation"], "replicas": 2, "updatedReplicas": 2}
    scenario.api.patch("Deployment", scenario.ns, "llama", {"status": {**ready, "readyReplicas": 1}}, sub="status")
    scenario.wait_status(lambda s, o: s.get("readyReplicas") == 1, "one ready replica")
    writes = child_writes(cluster, scenario.ns)
    versions = {kind: scenario.get(kind)["metadata"]["resourceVersion"] for kind in ("Deployment", "Service")}

    # Another pass over the same children (a child event): the defaults are not drift, nothing is applied.
    scenario.api.patch("Deployment", scenario.ns, "llama", {"status": {"readyReplicas": 2}}, sub="status")
    scenario.wait_status(lambda s, o: s.get("readyReplicas") == 2, "two ready replicas")
    assert child_writes(cluster, scenario.ns) == writes
    assert scenario.get("Service")["metadata"]["resourceVersion"] == versions["Service"]
    dep = scenario.get("Deployment")
    assert dep["metadata"]["generation"] == ready["observedGeneration"]  # no rollout
    assert not [e for e in scenario.events() if e.get("reason") in ("DriftReverted", "Recreating")]
