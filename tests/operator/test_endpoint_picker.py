"""Rendering the reference endpoint picker for spec.routing.endpointPicker.deploy (pure)."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml
from resource_factories import CONFIG, UID, body

from pagedllm.operator.endpoint_picker import DEFAULT_PICKER_IMAGE, PLUGINS_CONFIG
from pagedllm.operator.fleet_spec import parse_routing
from pagedllm.operator.manifests import RenderConfig, render, selector_labels
from pagedllm.operator.spec import SpecError


def picker_objects(routing: dict, config: RenderConfig = CONFIG) -> dict[str, dict]:
    rendered = render(body(routing=routing), config).all()
    return {m["kind"]: m for m in rendered if m["metadata"]["name"] != "llama"}


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def test_a_deployed_picker_serves_the_pool_it_is_named_after():
    objects = picker_objects({"inferencePool": True, "endpointPicker": {"deploy": True}})
    kinds = ["ConfigMap", "Deployment", "PodDisruptionBudget", "Role", "RoleBinding", "Service", "ServiceAccount"]
    assert sorted(objects) == kinds
    assert {m["metadata"]["name"] for m in objects.values()} == {"llama-epp"}
    pool = {
        m["kind"]: m
        for m in render(body(routing={"inferencePool": True, "endpointPicker": {"deploy": True}}), CONFIG).all()
    }
    ref = pool["InferencePool"]["spec"]["endpointPickerRef"]
    service, deployment = objects["Service"], objects["Deployment"]
    assert ref["name"] == service["metadata"]["name"]
    assert [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"] == [ref["port"]["number"]]
    pod = deployment["spec"]["template"]
    assert matches(service["spec"]["selector"], pod["metadata"]["labels"])
    # The pool selects the servers, never the picker.
    assert not matches(selector_labels("llama"), pod["metadata"]["labels"])
    (container,) = pod["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--pool-name") + 1] == "llama" and args[args.index("--pool-namespace") + 1] == "ml"
    assert args[args.index("--grpc-port") + 1] == "9002" and container["image"] == DEFAULT_PICKER_IMAGE
    config_file = args[args.index("--config-file") + 1]
    (mount,) = container["volumeMounts"]
    assert config_file.startswith(mount["mountPath"] + "/")
    assert pod["spec"]["volumes"] == [{"name": "config", "configMap": {"name": "llama-epp"}}]
    assert config_file.rsplit("/", 1)[1] in objects["ConfigMap"]["data"]
    assert pod["spec"]["serviceAccountName"] == "llama-epp"
    for obj in objects.values():
        assert obj["metadata"]["ownerReferences"][0]["uid"] == UID
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "pagedllm-operator"
        kubernetes_validate.validate({**obj, "metadata": {**obj["metadata"], "namespace": "ml"}}, "1.30", strict=True)


def test_the_picker_config_scores_every_signal_it_names():
    config = yaml.safe_load(PLUGINS_CONFIG)
    assert config["kind"] == "EndpointPickerConfig"
    declared = {plugin["type"] for plugin in config["plugins"]}
    (profile,) = config["schedulingProfiles"]
    assert {ref["pluginRef"] for ref in profile["plugins"]} == declared


def test_the_picker_reads_only_what_the_pool_needs():
    role = picker_objects({"inferencePool": True, "endpointPicker": {"deploy": True}})["Role"]
    verbs = {verb for rule in role["rules"] for verb in rule["verbs"]}
    assert verbs == {"get", "list", "watch"}
    assert {r for rule in role["rules"] for r in rule["resources"]} == {
        "pods",
        "inferencepools",
        "inferenceobjectives",
        "inferencemodelrewrites",
    }


def test_image_name_and_port_follow_the_spec_and_the_operator():
    operator = RenderConfig(default_image="img", endpoint_picker_image="mirror.example/epp:v1.0.1")
    picker = {"deploy": True, "name": "router", "port": 9100}
    objects = picker_objects({"inferencePool": True, "endpointPicker": picker}, operator)
    (container,) = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "mirror.example/epp:v1.0.1" and objects["Service"]["metadata"]["name"] == "router"
    assert {"name": "grpc", "containerPort": 9100, "protocol": "TCP"} in container["ports"]
    own = picker_objects({"inferencePool": True, "endpointPicker": {**picker, "image": "own/epp:2"}}, operator)
    assert own["Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"] == "own/epp:2"


def test_no_picker_without_deploy_or_without_a_pool():
    assert picker_objects({"inferencePool": True}) == {}
    assert picker_objects({"inferencePool": False, "endpointPicker": {"deploy": True}}) == {}


@pytest.mark.parametrize(
    "picker, message",
    [
        ({"deploy": "yes"}, "deploy='yes' has the wrong type"),
        ({"image": ""}, "image='' is not allowed"),
        ({"replicas": 2}, "unknown field"),
    ],
)
def test_bad_picker_fields_are_refused(picker, message):
    with pytest.raises(SpecError, match=message):
        parse_routing("spec.routing", {"inferencePool": True, "endpointPicker": picker})


PICKER_LABELS = {"app.kubernetes.io/name": "pagedllm-endpoint-picker", "app.kubernetes.io/instance": "llama"}


@pytest.mark.parametrize("nodes", [1, 2])
def test_two_pickers_with_resources_spread_over_nodes_and_a_budget(nodes):
    routing = {"inferencePool": True, "endpointPicker": {"deploy": True}}
    rendered = render(body(nodes=nodes, routing=routing), CONFIG).all()
    objects = {m["kind"]: m for m in rendered if m["metadata"]["name"] == "llama-epp"}
    deployment, budget = objects["Deployment"], objects["PodDisruptionBudget"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["selector"] == {"matchLabels": PICKER_LABELS}
    assert deployment["spec"]["template"]["metadata"]["labels"] == PICKER_LABELS
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = deployment["spec"]["template"]["spec"]
    assert pod["affinity"] == {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "labelSelector": {"matchLabels": PICKER_LABELS},
                        "topologyKey": "kubernetes.io/hostname",
                    },
                }
            ]
        }
    }
    (container,) = pod["containers"]
    assert container["resources"] == {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
    assert budget["metadata"]["name"] == "llama-epp"
    assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": PICKER_LABELS}}
    assert budget["metadata"]["ownerReferences"][0]["uid"] == UID
    kubernetes_validate.validate(budget, "1.30", strict=True)


def test_the_default_failure_mode_is_fail_close_and_fail_open_is_a_choice():
    pools = {
        mode: {m["kind"]: m for m in render(body(routing={"inferencePool": True, **extra}), CONFIG).all()}
        for mode, extra in (("default", {}), ("open", {"failureMode": "FailOpen"}))
    }
    assert pools["default"]["InferencePool"]["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    assert pools["open"]["InferencePool"]["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
