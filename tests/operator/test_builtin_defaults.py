"""The built-in kinds' defaults the emulated API server fills in."""

from __future__ import annotations

from builtin_defaults import default_object, pull_policy


def test_pull_policy_follows_the_image_tag():
    assert pull_policy("registry.example/server") == "Always"
    assert pull_policy("registry.example:5000/server:latest") == "Always"
    assert pull_policy("registry.example:5000/server") == "Always"  # a registry port is not a tag
    assert pull_policy("registry.example/server:1.0") == "IfNotPresent"
    assert pull_policy("registry.example/server@sha256:" + "0" * 64) == "IfNotPresent"


def test_given_values_are_kept_and_only_missing_ones_filled():
    spec = {"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1}}, "revisionHistoryLimit": 3}
    spec["template"] = {"spec": {"containers": [{"name": "c", "image": "i:1", "imagePullPolicy": "Always"}]}}
    obj = default_object({"apiVersion": "apps/v1", "kind": "Deployment", "spec": spec})
    assert obj["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": "25%"}
    assert obj["spec"]["revisionHistoryLimit"] == 3 and obj["spec"]["progressDeadlineSeconds"] == 600
    assert obj["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] == "Always"
    assert "progressDeadlineSeconds" not in spec  # the given object is not changed


def test_a_job_a_stateful_set_and_probes():
    probe = {"httpGet": {"path": "/health", "port": 8000}}
    pod = {"restartPolicy": "Never", "containers": [{"name": "c", "image": "i:1", "readinessProbe": probe}]}
    job = default_object({"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": pod}}})["spec"]
    assert (job["completions"], job["parallelism"], job["backoffLimit"]) == (1, 1, 6)
    assert job["template"]["spec"]["restartPolicy"] == "Never"
    ready = job["template"]["spec"]["containers"][0]["readinessProbe"]
    assert ready == {**probe, "httpGet": {**probe["httpGet"], "scheme": "HTTP"}} | {
        "timeoutSeconds": 1,
        "periodSeconds": 10,
        "successThreshold": 1,
        "failureThreshold": 3,
    }
    sts = default_object({"apiVersion": "apps/v1", "kind": "StatefulSet", "spec": {"template": {"spec": pod}}})
    assert sts["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}}
    assert sts["spec"]["podManagementPolicy"] == "OrderedReady"


def test_other_kinds_and_wrongly_typed_objects_are_left_as_given():
    widget = {"apiVersion": "example.com/v1", "kind": "Widget", "spec": {}}
    assert default_object(widget) is widget
    typed = {"apiVersion": "apps/v1", "kind": "Deployment", "spec": {"template": {"spec": {"containers": 3}}}}
    assert default_object(typed) is typed
