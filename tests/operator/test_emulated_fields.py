"""The emulated API server as a real one treats fields: ``fieldValidation``, built-in defaults, every CRD's CEL
rules, and the ownership of labels and annotations under server-side apply (conflicts without ``force``)."""

from __future__ import annotations

import kmock
import pytest
import yaml
from emulated_scenario import pagedllm
from helm_tools import CRD_PATH
from k8s_emulator import Client, EmulatedCluster

NS = "ml"
APPLY = "application/apply-patch+yaml"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
SERVICES = f"/api/v1/namespaces/{NS}/services"
PAGEDLLMS = f"/apis/pagedllm.dev/v1alpha1/namespaces/{NS}/pagedllms"
WIDGETS = f"/apis/example.com/v1/namespaces/{NS}/widgets"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def widget_crd() -> dict:
    """A CRD with CEL rules on a nested field, on list items, on map values and one transition rule."""
    item = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "weight": {"type": "integer"}},
        "x-kubernetes-validations": [{"rule": "self.weight > 0", "message": "weight must be positive"}],
    }
    spec = {
        "type": "object",
        "properties": {
            "size": {
                "type": "object",
                "properties": {"min": {"type": "integer"}, "max": {"type": "integer"}},
                "x-kubernetes-validations": [{"rule": "self.min <= self.max", "message": "min above max"}],
            },
            "items": {"type": "array", "items": item},
            "limits": {
                "type": "object",
                "additionalProperties": {"type": "string", "x-kubernetes-validations": [{"rule": "self != ''"}]},
            },
            "tier": {
                "type": "string",
                "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "tier is immutable"}],
            },
        },
    }
    schema = {"type": "object", "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"}}}
    schema["properties"] |= {"metadata": {"type": "object"}, "spec": spec}
    version = {"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": schema}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {
            "group": "example.com",
            "scope": "Namespaced",
            "names": {"kind": "Widget", "plural": "widgets", "singular": "widget", "listKind": "WidgetList"},
            "versions": [version],
        },
    }


@pytest.fixture(scope="module")
def api():
    emulated = EmulatedCluster().start()
    emulated.install({"example.com/v1/widgets": kmock.ResourceInfo(kind="Widget", singular="widget", namespaced=True)})
    client = Client(emulated.url)
    for crd in (yaml.safe_load(CRD_PATH.read_text()), widget_crd()):
        status, body = client.request("POST", CRDS, crd, "application/json")
        assert status in (200, 201), body
    yield client
    emulated.stop()


def deployment(name: str, image: str = "registry.example/server:1.0", **spec) -> dict:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [{"name": "c", "image": image}]}},
            **spec,
        },
    }


def typo(name: str) -> dict:
    obj = deployment(name, replicaz=2)
    obj["spec"]["template"]["spec"]["containers"][0]["imagePullPolize"] = "Always"
    return obj


UNKNOWN = [
    '299 - "unknown field \\"spec.replicaz\\""',
    '299 - "unknown field \\"spec.template.spec.containers[0].imagePullPolize\\""',
]


# -- fieldValidation --------------------------------------------------------------------------------------------


def test_warn_is_the_default_unknown_fields_are_dropped_with_a_warning_each(api):
    for name, query in (("warned", "?fieldValidation=Warn"), ("defaulted", "?fieldValidation=")):
        status, body, warnings = api.send("POST", DEPLOYMENTS + query, typo(name), "application/json")
        assert status in (200, 201), body
        assert sorted(warnings) == sorted(UNKNOWN)
        stored = api.get("Deployment", NS, name)
        assert (
            "replicaz" not in stored["spec"]
            and "imagePullPolize" not in stored["spec"]["template"]["spec"]["containers"][0]
        )


def test_ignore_drops_unknown_fields_silently_and_strict_refuses_them(api):
    status, _, warnings = api.send("POST", DEPLOYMENTS + "?fieldValidation=Ignore", typo("ignored"), "application/json")
    assert status in (200, 201) and warnings == []
    assert "replicaz" not in api.get("Deployment", NS, "ignored")["spec"]
    status, body, _ = api.send("POST", DEPLOYMENTS + "?fieldValidation=Strict", typo("strict"), "application/json")
    assert status == 422 and "replicaz" in body["message"], body
    assert api.get("Deployment", NS, "strict") is None


def test_a_patch_or_apply_with_an_unknown_field_keeps_the_rest_and_warns(api):
    api.create(deployment("patched"))
    status, body, warnings = api.send(
        "PATCH", f"{DEPLOYMENTS}/patched?fieldValidation=Warn", {"spec": {"paused": True, "pausd": 1}}
    )
    assert status == 200 and warnings == ['299 - "unknown field \\"spec.pausd\\""'], (body, warnings)
    stored = api.get("Deployment", NS, "patched")
    assert stored["spec"]["paused"] is True and "pausd" not in stored["spec"]
    applied = pagedllm(NS, "warned") | {"spec": {"model": "m", "maxNumSeqz": 3}}
    status, body, warnings = api.send(
        "PATCH", f"{PAGEDLLMS}/warned?fieldManager=op&fieldValidation=Warn", applied, APPLY
    )
    assert status in (200, 201) and warnings == ['299 - "unknown field \\"spec.maxNumSeqz\\""'], (body, warnings)
    assert "maxNumSeqz" not in api.get("PagedLLM", NS, "warned")["spec"]
    managed = api.get("PagedLLM", NS, "warned")["metadata"]["managedFields"]
    assert "f:maxNumSeqz" not in managed[0]["fieldsV1"]["f:spec"]


# -- built-in defaults ------------------------------------------------------------------------------------------


def test_a_deployment_is_stored_with_the_api_servers_defaults(api):
    created = api.create(deployment("bare"))
    spec = created["spec"]
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"}}
    assert (spec["replicas"], spec["revisionHistoryLimit"], spec["progressDeadlineSeconds"]) == (1, 10, 600)
    pod = spec["template"]["spec"]
    assert (pod["restartPolicy"], pod["dnsPolicy"], pod["terminationGracePeriodSeconds"]) == (
        "Always",
        "ClusterFirst",
        30,
    )
    (container,) = pod["containers"]
    assert container["imagePullPolicy"] == "IfNotPresent"
    assert (container["terminationMessagePath"], container["terminationMessagePolicy"]) == (
        "/dev/termination-log",
        "File",
    )
    latest = api.create(deployment("latest", image="registry.example/server", strategy={"type": "Recreate"}))
    assert latest["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] == "Always"
    assert latest["spec"]["strategy"] == {"type": "Recreate"}


def test_a_service_is_stored_with_the_api_servers_defaults(api):
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "svc", "namespace": NS}}
    service["spec"] = {"selector": {"app": "x"}, "ports": [{"name": "http", "port": 80}]}
    spec = api.create(service)["spec"]
    assert (spec["type"], spec["sessionAffinity"], spec["ipFamilies"], spec["ipFamilyPolicy"]) == (
        "ClusterIP",
        "None",
        ["IPv4"],
        "SingleStack",
    )
    assert spec["clusterIPs"] == [spec["clusterIP"]] and spec["ports"] == [
        {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 80}
    ]


def test_defaults_are_owned_by_nobody_and_come_back_when_an_applier_drops_its_value(api):
    manifest = deployment("applied", replicas=4)
    status, body = api.request("PATCH", f"{DEPLOYMENTS}/applied?fieldManager=op", manifest, APPLY)
    assert status in (200, 201), body
    stored = api.get("Deployment", NS, "applied")
    assert stored["spec"]["replicas"] == 4 and stored["spec"]["revisionHistoryLimit"] == 10
    (entry,) = stored["metadata"]["managedFields"]
    assert "f:revisionHistoryLimit" not in entry["fieldsV1"]["f:spec"] and "f:replicas" in entry["fieldsV1"]["f:spec"]
    del manifest["spec"]["replicas"]  # its only applier drops it: removed, then defaulted again
    status, body = api.request("PATCH", f"{DEPLOYMENTS}/applied?fieldManager=op", manifest, APPLY)
    assert status == 200 and body["spec"]["replicas"] == 1, body
    assert body["metadata"]["generation"] == 2


# -- CEL rules of every CRD -------------------------------------------------------------------------------------


def widget(name: str, **spec) -> dict:
    return {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": name, "namespace": NS}, "spec": spec}


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ({"size": {"min": 3, "max": 1}}, "spec.size", "min above max"),
        (
            {"items": [{"name": "a", "weight": 1}, {"name": "b", "weight": 0}]},
            "spec.items[1]",
            "weight must be positive",
        ),
        ({"limits": {"cpu": ""}}, "spec.limits[cpu]", "failed rule: self != ''"),
    ],
)
def test_the_cel_rules_of_any_crd_are_checked_at_every_field(api, spec, field, message):
    status, body = api.request("POST", WIDGETS, widget("bad", **spec), "application/json")
    assert status == 422, body
    assert f'{field}: Invalid value: "object": {message}' in body["message"]


def test_a_transition_rule_compares_with_the_stored_object(api):
    status, body = api.request(
        "POST", WIDGETS, widget("tiered", tier="gold", size={"min": 1, "max": 2}), "application/json"
    )
    assert status in (200, 201), body
    status, body = api.request("PATCH", f"{WIDGETS}/tiered", {"spec": {"tier": "silver"}})
    assert status == 422 and 'spec.tier: Invalid value: "object": tier is immutable' in body["message"], body
    status, body = api.request("PATCH", f"{WIDGETS}/tiered", {"spec": {"size": {"max": 5}}})
    assert status == 200 and body["spec"]["tier"] == "gold", body


# -- field ownership beyond spec --------------------------------------------------------------------------------


def labelled(name: str, labels: dict, **spec) -> dict:
    obj = deployment(name, **spec)
    obj["metadata"]["labels"] = labels
    return obj


def labels_only(name: str, labels: dict) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
    }


def apply_as(api, manager: str, body: dict, *, force: bool = False) -> tuple[int, dict]:
    query = f"?fieldManager={manager}" + ("&force=true" if force else "")
    return api.request("PATCH", f"{DEPLOYMENTS}/{body['metadata']['name']}{query}", body, APPLY)


def test_labels_are_owned_one_by_one_and_an_appliers_dropped_label_goes(api):
    assert apply_as(api, "op", labelled("owned", {"a": "1", "b": "1", "c": "1"}))[0] in (200, 201)
    assert apply_as(api, "team", labels_only("owned", {"c": "1"}))[0] == 200
    status, body = apply_as(api, "op", labelled("owned", {"a": "1"}))
    assert status == 200 and body["metadata"]["labels"] == {"a": "1", "c": "1"}, body  # c: team still owns it
    entries = {e["manager"]: e["fieldsV1"] for e in body["metadata"]["managedFields"]}
    assert entries["op"]["f:metadata"] == {"f:labels": {"f:a": {}}}
    assert entries["team"]["f:metadata"] == {"f:labels": {"f:c": {}}}


def test_an_unforced_apply_of_another_managers_field_is_a_conflict(api):
    assert apply_as(api, "op", labelled("contested", {"tier": "gold"}, replicas=2))[0] in (200, 201)
    status, body = apply_as(api, "hand", labels_only("contested", {"tier": "silver"}) | {"spec": {"replicas": 5}})
    assert status == 409 and body["reason"] == "Conflict", body
    assert body["message"] == (
        'Apply failed with 2 conflicts: conflict with "op" using apps/v1: .metadata.labels.tier; '
        'conflict with "op" using apps/v1: .spec.replicas'
    )
    assert api.get("Deployment", NS, "contested")["metadata"]["labels"] == {"tier": "gold"}
    # The same value is no conflict: both managers own the field.
    assert apply_as(api, "hand", labels_only("contested", {"tier": "gold"}))[0] == 200
    # Forced, the field moves to the new manager; an update (merge patch) never conflicts.
    status, body = apply_as(api, "hand", labels_only("contested", {"tier": "silver"}), force=True)
    assert status == 200 and body["metadata"]["labels"] == {"tier": "silver"}, body
    op = next(e for e in body["metadata"]["managedFields"] if e["manager"] == "op")
    assert "f:metadata" not in op["fieldsV1"]
    assert api.patch("Deployment", NS, "contested", {"metadata": {"labels": {"tier": "bronze"}}})["metadata"]["labels"]


def test_a_create_is_owned_by_its_manager_as_an_update(api):
    created = api.create(labelled("posted", {"team": "ml"}))
    (entry,) = created["metadata"]["managedFields"]
    assert (entry["manager"], entry["operation"]) == ("pagedllm-tests", "Update")
    # As the API server records an update: the object it stored, defaults included.
    assert "f:team" in entry["fieldsV1"]["f:metadata"]["f:labels"] and "f:strategy" in entry["fieldsV1"]["f:spec"]
    status, body = apply_as(api, "op", labelled("posted", {"team": "infra"}))
    assert status == 409 and '"pagedllm-tests"' in body["message"], body
