"""The operator against hand edits, refusals of the API and objects it does not own (emulated cluster)."""

from __future__ import annotations

import time

import pytest
from emulated_scenario import condition, pagedllm

pytestmark = pytest.mark.k8s

# How long the tests watch for a retry loop after a refusal.
QUIET_SECONDS = 3


def operator_calls(cluster, method: str, path: str) -> int:
    return sum(1 for r in cluster.operator_requests() if r.method.value == method and r.url.path == path)


def degraded(reason: str):
    return lambda s, o: (
        (condition(o, "Degraded").get("status"), condition(o, "Degraded").get("reason"))
        == (
            "True",
            reason,
        )
    )


def test_hand_edited_replicas_are_reverted(scenario):
    scenario.api.create(pagedllm(scenario.ns, replicas=1))
    scenario.wait_deployment()
    scenario.api.patch("Deployment", scenario.ns, "llama", {"spec": {"replicas": 5}})
    reverted = scenario.wait(
        lambda: (d := scenario.get("Deployment")) and d["spec"]["replicas"] == 1 and d, "replicas back at 1", timeout=10
    )
    assert reverted["metadata"]["ownerReferences"][0]["kind"] == "PagedLLM"
    events = [e for e in scenario.events() if e.get("reason") == "DriftReverted"]
    assert events and "spec.replicas" in events[0]["message"]


def test_hand_edited_service_type_is_reverted(scenario):
    scenario.api.create(pagedllm(scenario.ns))
    scenario.wait(lambda: scenario.get("Service"), "the Service")
    scenario.api.patch("Service", scenario.ns, "llama", {"spec": {"type": "NodePort"}})
    scenario.wait(lambda: (scenario.get("Service") or {}).get("spec", {}).get("type") == "ClusterIP", "ClusterIP")


def test_forbidden_apply_is_degraded_with_the_message_and_not_retried_hot(scenario, cluster):
    path = f"/apis/apps/v1/namespaces/{scenario.ns}/deployments/llama"
    message = f'deployments.apps "llama" is forbidden: User "system:serviceaccount:x:op" cannot patch in {scenario.ns}'
    cluster.refuse("PATCH", path, 403, message)
    scenario.api.create(pagedllm(scenario.ns))
    obj = scenario.wait_status(degraded("ApplyRefused"), "Degraded/ApplyRefused")
    assert message in condition(obj, "Degraded")["message"]
    assert scenario.get("Service") is not None, "the Service is applied although the Deployment was refused"
    attempts = operator_calls(cluster, "PATCH", path)
    time.sleep(QUIET_SECONDS)  # NOTE: proving the absence of a retry loop needs a stretch of time
    assert attempts == 1 and operator_calls(cluster, "PATCH", path) == attempts
    warnings = [e for e in scenario.events() if e.get("reason") == "ApplyRefused"]
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning"


def test_an_immutable_claim_does_not_block_the_deployment(scenario, cluster):
    path = f"/api/v1/namespaces/{scenario.ns}/persistentvolumeclaims/llama-model-cache"
    cluster.refuse("PATCH", path, 422, 'PersistentVolumeClaim "llama-model-cache" is invalid: spec: Forbidden')
    scenario.api.create(pagedllm(scenario.ns, modelCache={"size": "10Gi"}))
    obj = scenario.wait_status(degraded("ApplyRefused"), "Degraded/ApplyRefused")
    assert "PersistentVolumeClaim llama-model-cache" in condition(obj, "Degraded")["message"]
    scenario.api.patch("PagedLLM", scenario.ns, "llama", {"spec": {"logLevel": "debug"}})
    scenario.wait_deployment(lambda d: "debug" in str(d["spec"]["template"]), "the Deployment updated")
    assert scenario.get("Service") is not None


def test_a_same_named_deployment_of_another_owner_is_not_taken_over(scenario):
    theirs = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": "llama",
            "namespace": scenario.ns,
            "ownerReferences": [
                {"apiVersion": "example.com/v1", "kind": "Notebook", "name": "lab", "uid": "u-1", "controller": True}
            ],
        },
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "lab"}},
            "template": {
                "metadata": {"labels": {"app": "lab"}},
                "spec": {"containers": [{"name": "lab", "image": "lab:1"}]},
            },
        },
    }
    scenario.api.create(theirs)
    scenario.api.create(pagedllm(scenario.ns))
    obj = scenario.wait_status(degraded("AdoptionRefused"), "Degraded/AdoptionRefused")
    assert "Deployment llama" in condition(obj, "Degraded")["message"]
    assert "Notebook/lab" in condition(obj, "Degraded")["message"]
    assert scenario.get("Service") is not None
    untouched = scenario.get("Deployment")
    assert [r["kind"] for r in untouched["metadata"]["ownerReferences"]] == ["Notebook"]
    assert untouched["spec"]["replicas"] == 3


def test_children_are_watched_through_a_label_selector(cluster, operator, scenario):
    scenario.api.create(pagedllm(scenario.ns))
    scenario.wait_deployment()
    watches = [
        r
        for r in cluster.operator_requests()
        if r.method.value == "GET" and r.url.path.endswith(("/deployments", "/services", "/pods"))
    ]
    assert watches
    # NOTE: watches select exactly the operator's children; a list may narrow that to one instance.
    managed = "app.kubernetes.io/managed-by=pagedllm-operator"
    assert all(managed in (r.params.get("labelSelector") or "").split(",") for r in watches)
    assert any(r.params.get("labelSelector") == managed for r in watches)
