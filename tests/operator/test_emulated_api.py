"""The emulated API server's own behaviour: validation (422), server-side apply merging lists by key."""

from __future__ import annotations

import pytest
import yaml
from emulated_scenario import pagedllm
from helm_tools import CRD_PATH
from k8s_emulator import OPTIONAL_RESOURCE_INFOS, Client, EmulatedCluster

NS = "ml"
APPLY = "application/apply-patch+yaml"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"


@pytest.fixture(scope="module")
def api():
    emulated = EmulatedCluster().start()
    emulated.install(OPTIONAL_RESOURCE_INFOS)  # KEDA's, the LeaderWorkerSet's ... CRDs
    client = Client(emulated.url)
    status, body = client.request(
        "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", yaml.safe_load(CRD_PATH.read_text())
    )
    assert status == 201 or status == 200, body
    yield client
    emulated.stop()


def deployment(name: str, *containers: dict) -> dict:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": list(containers)}},
        },
    }


def test_unknown_fields_and_wrong_types_are_422(api):
    bad = deployment("typo", {"name": "c", "image": "i", "imagePullPolicyy": "Always"})
    status, body = api.request("POST", DEPLOYMENTS, bad, "application/json")
    assert (status, body["reason"]) == (422, "Invalid")
    assert body["message"].startswith('Deployment.apps "typo" is invalid: spec.template.spec.containers[0]')
    assert "imagePullPolicyy" in body["message"]
    status, body = api.request("POST", DEPLOYMENTS, deployment("typed", {"name": "c", "image": 3}), "application/json")
    assert status == 422 and "containers[0].image" in body["message"]
    assert api.get("Deployment", NS, "typo") is None

    api.create(deployment("good", {"name": "c", "image": "i"}))
    status, body = api.request("PATCH", f"{DEPLOYMENTS}/good", {"spec": {"replicas": "two"}})
    assert status == 422 and "spec.replicas" in body["message"]
    assert api.get("Deployment", NS, "good")["spec"]["replicas"] == 1  # the default, not the refused value


def test_pagedllm_writes_are_checked_against_the_crd(api):
    status, body = api.request("POST", f"/apis/pagedllm.dev/v1alpha1/namespaces/{NS}/pagedllms",
                               pagedllm(NS, blockSize=12), "application/json")  # fmt: skip
    assert status == 422 and "spec.blockSize" in body["message"]
    status, body = api.request("POST", f"/apis/pagedllm.dev/v1alpha1/namespaces/{NS}/pagedllms",
                               pagedllm(NS, blokSize=16), "application/json")  # fmt: skip
    assert status == 422 and "blokSize" in body["message"]


def test_an_object_an_older_schema_admitted_can_still_be_written(api):
    api.create(pagedllm(NS, "old", blockSize=12), unchecked=True)
    api.patch("PagedLLM", NS, "old", {"status": {"phase": "Degraded"}}, sub="status")  # ratcheting
    status, _ = api.request("PATCH", f"/apis/pagedllm.dev/v1alpha1/namespaces/{NS}/pagedllms/old",
                            {"spec": {"replicas": "x"}})  # fmt: skip
    assert status == 422  # a new error is still refused


def test_two_appliers_merge_containers_by_name(api):
    path = f"{DEPLOYMENTS}/merged"
    first = deployment("merged", {"name": "server", "image": "v1", "env": [{"name": "A", "value": "1"}]})
    assert api.request("PATCH", f"{path}?fieldManager=op", first, APPLY)[0] == 200
    sidecar = deployment("merged", {"name": "proxy", "image": "envoy"})
    assert api.request("PATCH", f"{path}?fieldManager=mesh", sidecar, APPLY)[0] == 200
    names = [c["name"] for c in api.get("Deployment", NS, "merged")["spec"]["template"]["spec"]["containers"]]
    assert names == ["server", "proxy"]

    # The operator's next apply changes its container's env (merged by name too); the sidecar stays.
    again = deployment("merged", {"name": "server", "image": "v2", "env": [{"name": "B", "value": "2"}]})
    assert api.request("PATCH", f"{path}?fieldManager=op", again, APPLY)[0] == 200
    server, proxy = api.get("Deployment", NS, "merged")["spec"]["template"]["spec"]["containers"]
    assert (server["image"], server["env"], proxy["name"]) == ("v2", [{"name": "B", "value": "2"}], "proxy")

    # The mesh stops applying its sidecar: it goes, the operator's container stays.
    alone = deployment("merged", {"name": "server", "image": "v2"})
    alone["spec"]["template"]["spec"]["containers"] = []
    assert api.request("PATCH", f"{path}?fieldManager=mesh", alone, APPLY)[0] == 200
    (server,) = api.get("Deployment", NS, "merged")["spec"]["template"]["spec"]["containers"]
    assert server["name"] == "server" and server["image"] == "v2"


PAGEDLLMS = f"/apis/pagedllm.dev/v1alpha1/namespaces/{NS}/pagedllms"


def test_pagedllms_are_defaulted_on_create_and_on_patch(api):
    created = api.create(pagedllm(NS, "defaulted"))
    assert (created["spec"]["blockSize"], created["spec"]["port"]) == (16, 8000)
    assert api.get("PagedLLM", NS, "defaulted")["spec"]["networkPolicy"] == {"enabled": True}
    patched = api.patch("PagedLLM", NS, "defaulted", {"spec": {"modelCache": {"size": "1Gi"}}})
    assert patched["spec"]["modelCache"]["retainPolicy"] == "Retain"


def test_unknown_pagedllm_fields_are_pruned_when_asked_and_refused_by_default(api):
    typo = pagedllm(NS, "pruned", blokSize=32)
    assert api.request("POST", PAGEDLLMS, typo, "application/json")[0] == 422
    status, body = api.request("POST", f"{PAGEDLLMS}?fieldValidation=Ignore", typo, "application/json")
    assert status in (200, 201) and "blokSize" not in body["spec"] and body["spec"]["blockSize"] == 16


def test_pagedllm_cel_rules_refuse_what_they_say(api):
    public = pagedllm(NS, "public", serviceType="LoadBalancer")
    status, body = api.request("POST", PAGEDLLMS, public, "application/json")
    assert status == 422 and "apiKeySecret" in body["message"]
    scaling = {"minReplicas": 1, "maxReplicas": 3, "metric": "kvCache", "target": 0.7}
    api.create(pagedllm(NS, "scaled", autoscaling=scaling))
    status, body = api.request("PATCH", f"{PAGEDLLMS}/scaled", {"spec": {"replicas": 2}})
    assert status == 422 and "replicas and autoscaling exclude each other" in body["message"]


def test_a_merge_patch_that_removes_a_pagedllm_field_removes_it(api):
    api.create(pagedllm(NS, "unscaled", replicas=3))
    scaling = {"minReplicas": 1, "maxReplicas": 3, "metric": "kvCache", "target": 0.7}
    patched = api.patch("PagedLLM", NS, "unscaled", {"spec": {"replicas": None, "autoscaling": scaling}})
    assert "replicas" not in patched["spec"] and patched["spec"]["autoscaling"]["minReplicas"] == 1


@pytest.mark.parametrize(
    ("path", "obj"),
    [
        (
            f"/apis/keda.sh/v1alpha1/namespaces/{NS}/scaledobjects",
            {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "s"},
             "spec": {"scaleTargetRef": {"name": "llama"}, "triggers": [], "maxReplicaCont": 3}},
        ),
        (
            f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets",
            {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": {"name": "l"},
             "spec": {"replicas": "one"}},
        ),
    ],
)  # fmt: skip
def test_writes_of_other_projects_kinds_are_checked_too(api, path, obj):
    status, body = api.request("POST", path, obj, "application/json")
    assert status == 422, body
