"""Rendering the fleet objects (pure): autoscaler, disruption budget, InferencePool, PodMonitor."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from resource_factories import CONFIG, KEDA, body
from third_party_schemas import validate_manifest

from pagedllm.operator.autoscaling import MAX_KEDA_NAME, METRIC_SERIES, pod_pattern, prometheus_query, quantity
from pagedllm.operator.drift import drifted
from pagedllm.operator.fleet_spec import parse_routing
from pagedllm.operator.manifests import RenderConfig, render, selector_labels
from pagedllm.operator.routing import endpoint_picker_name
from pagedllm.operator.spec import SpecError
from pagedllm.operator.status import status_from


def by_kind(manifests) -> dict[str, dict]:
    return {m["kind"]: m for m in manifests.all()}


def scaling(**fields) -> dict:
    return {"autoscaling": {"maxReplicas": 4, "target": 3, **fields}}


@pytest.mark.parametrize("metric", ["queue", "kvCache", "runningRequests"])
def test_hpa_scales_the_deployment_on_the_servers_gauge(metric):
    target = 0.8 if metric == "kvCache" else 3
    kinds = by_kind(render(body(**scaling(metric=metric, target=target, scaleDownDelaySeconds=120)), CONFIG))
    hpa = kinds["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2" and "ScaledObject" not in kinds
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)
    (pods_metric,) = hpa["spec"]["metrics"]
    assert pods_metric["type"] == "Pods"
    assert pods_metric["pods"]["metric"] == {"name": METRIC_SERIES[metric]}
    assert pods_metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "800m" if target < 1 else "3"}
    assert hpa["spec"]["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 120}}
    kubernetes_validate.validate(hpa, "1.30", strict=True)


def test_metric_series_are_the_ones_the_server_exports():
    assert METRIC_SERIES == {
        "queue": "pagedllm:num_requests_waiting",
        "runningRequests": "pagedllm:num_requests_running",
        "kvCache": "pagedllm:kv_cache_usage_perc",
    }


def test_autoscaled_deployment_leaves_replicas_to_the_autoscaler():
    manifests = render(body(**scaling()), CONFIG)
    assert "replicas" not in manifests.deployment["spec"]
    assert render(body(replicas=3), CONFIG).deployment["spec"]["replicas"] == 3
    assert render(body(), CONFIG).deployment["spec"]["replicas"] == 1
    # a hand-set (autoscaler-set) replica count is no drift then
    live = copy.deepcopy(manifests.deployment)
    live["spec"]["replicas"] = 3
    assert drifted(manifests.deployment, live) == []


def test_replicas_with_autoscaling_is_refused():
    with pytest.raises(SpecError, match=r"spec.replicas=2 is not allowed with spec.autoscaling"):
        render(body(replicas=2, **scaling()), CONFIG)


def test_scale_to_zero_needs_keda():
    refusal = r"minReplicas=0 is not allowed here: scaling to zero needs KEDA.*autoscaler=keda"
    with pytest.raises(SpecError, match=refusal):
        render(body(**scaling(minReplicas=0)), CONFIG)
    assert by_kind(render(body(**scaling(minReplicas=0)), KEDA))["ScaledObject"]["spec"]["minReplicaCount"] == 0


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"minReplicas": 5}, r"minReplicas=5 is out of range: must be <= maxReplicas \(4\)"),
        ({"metric": "kvCache", "target": 2}, r"target=2 is out of range: the kvCache metric is a fraction"),
        ({"metric": "tokens"}, r"metric='tokens' is not allowed"),
        ({"target": 0}, r"target=0 is not allowed: must be a number > 0"),
        ({"maxReplicas": None}, r"maxReplicas is required"),
    ],
)
def test_autoscaling_refusals_name_the_field(fields, message):
    with pytest.raises(SpecError, match=message):
        render(body(**scaling(**fields)), CONFIG)


def test_keda_scaled_object_queries_prometheus_for_the_resources_pods():
    kinds = by_kind(render(body(**scaling(metric="kvCache", target=0.75, scaleDownDelaySeconds=600)), KEDA))
    assert "HorizontalPodAutoscaler" not in kinds
    scaled = kinds["ScaledObject"]
    validate_manifest(scaled)
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == "llama"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["cooldownPeriod"]) == (1, 4, 600)
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 600
    }
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    assert meta["serverAddress"] == "http://prom.monitoring.svc:9090" and meta["threshold"] == "0.75"
    assert meta["query"] == prometheus_query("llama", "ml", "kvCache")
    assert 'pagedllm:kv_cache_usage_perc{namespace="ml",pod=~"llama-[a-z0-9]+-[a-z0-9]+"}' in meta["query"]


def test_pod_pattern_matches_only_this_resources_pods():
    pattern = re.compile(pod_pattern("llama"))  # PromQL anchors =~ on both ends
    assert pattern.fullmatch("llama-7f9c8d6b5-x2k4p")
    assert not pattern.fullmatch("llama-big-7f9c8d6b5-x2k4p")
    assert not pattern.fullmatch("other-7f9c8d6b5-x2k4p")


def test_keda_needs_a_name_its_pod_pattern_can_match():
    longest = "l" * MAX_KEDA_NAME
    # the longest pod name Kubernetes makes for it: hash of 10, the whole cut to 58, then 5 random characters
    pod = f"{longest}-7f9c8d6b5a-"[:58] + "x2k4p"
    assert re.compile(pod_pattern(longest)).fullmatch(pod)
    named = body(**scaling())
    named["metadata"]["name"] = longest + "x"
    with pytest.raises(SpecError, match=rf"too long for KEDA autoscaling.*at most {MAX_KEDA_NAME}"):
        render(named, KEDA)
    assert by_kind(render(named, CONFIG))["HorizontalPodAutoscaler"]  # the HPA selects pods by label


def test_quantities():
    assert [quantity(v) for v in (4, 4.0, 0.8, 0.25, 1.5)] == ["4", "4", "800m", "250m", "1500m"]


@pytest.mark.parametrize(
    "spec, budget",
    [
        ({}, False),
        ({"replicas": 2}, True),
        ({"autoscaling": {"maxReplicas": 3, "target": 1}}, True),
        ({"autoscaling": {"maxReplicas": 1, "target": 1}}, False),
    ],
)
def test_disruption_budget_when_more_than_one_replica_may_run(spec, budget):
    kinds = by_kind(render(body(**spec), CONFIG))
    assert ("PodDisruptionBudget" in kinds) == budget
    if budget:
        pdb = kinds["PodDisruptionBudget"]
        assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels("llama")}}
        kubernetes_validate.validate(pdb, "1.30", strict=True)


def test_inference_pool_selects_the_server_pods():
    manifests = render(body(routing={"inferencePool": True}), CONFIG)
    pool = by_kind(manifests)["InferencePool"]
    validate_manifest(pool)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"] == {"matchLabels": manifests.service["spec"]["selector"]}
    assert (
        pool["spec"]["selector"]["matchLabels"].items()
        <= manifests.deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": "llama-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    assert "InferencePool" not in by_kind(render(body(), CONFIG))
    routing = {"inferencePool": True, "endpointPicker": {"name": "epp", "port": 9100}, "failureMode": "FailOpen"}
    picked = render(body(routing=routing), CONFIG)
    ref = by_kind(picked)["InferencePool"]["spec"]["endpointPickerRef"]
    assert (ref["name"], ref["port"], ref["failureMode"]) == ("epp", {"number": 9100}, "FailOpen")


def test_pod_monitor_and_scrape_annotations():
    manifests = render(body(port=8080), CONFIG)
    monitor = by_kind(manifests)["PodMonitor"]
    validate_manifest(monitor)
    assert monitor["spec"]["selector"] == {"matchLabels": selector_labels("llama")}
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert manifests.deployment["spec"]["template"]["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8080",
        "prometheus.io/path": "/metrics",
    }


def test_pod_monitor_carries_the_labels_prometheus_selects_by():
    config = RenderConfig(default_image="img", pod_monitor_labels=(("release", "kps"),))
    monitor = by_kind(render(body(), config))["PodMonitor"]
    validate_manifest(monitor)
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "pagedllm-operator"
    assert "release" not in by_kind(render(body(replicas=2), config))["PodDisruptionBudget"]["metadata"].get(
        "labels", {}
    )


def test_fleet_objects_are_labelled_and_owned():
    manifests = render(body(routing={"inferencePool": True}, **scaling()), KEDA)
    for kind in ("ScaledObject", "InferencePool", "PodMonitor", "PodDisruptionBudget"):
        meta = by_kind(manifests)[kind]["metadata"]
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "pagedllm-operator", kind
        assert meta["namespace"] == "ml" and meta["ownerReferences"][0]["kind"] == "PagedLLM", kind


@pytest.mark.parametrize(
    "kind, mistake",
    [
        ("ScaledObject", lambda m: m["spec"].pop("triggers")),
        ("ScaledObject", lambda m: m["spec"]["triggers"][0]["metadata"].update(threshold=3)),
        ("InferencePool", lambda m: m["spec"].update(targetPortNumber=8000)),  # the v1alpha2 field
        ("InferencePool", lambda m: m["spec"]["endpointPickerRef"].pop("port")),
        ("PodMonitor", lambda m: m["spec"].pop("selector")),
        ("PodMonitor", lambda m: m["spec"]["podMetricsEndpoints"][0].update(interval="soon")),
    ],
)
def test_the_third_party_schemas_catch_mistakes(kind, mistake):
    manifest = copy.deepcopy(by_kind(render(body(routing={"inferencePool": True}, **scaling()), KEDA))[kind])
    validate_manifest(manifest)
    mistake(manifest)
    with pytest.raises(jsonschema.ValidationError):
        validate_manifest(manifest)


def test_status_desired_replicas_follow_the_autoscaler():
    resource = body(**scaling(minReplicas=2))
    assert status_from(resource, None, now="t")["desiredReplicas"] == 2
    scaled = {"spec": {"replicas": 3}, "status": {"replicas": 3, "readyReplicas": 1}}
    status = status_from(resource, scaled, now="t")
    assert (status["desiredReplicas"], status["replicas"], status["ready"]) == (3, 3, "1/3")
    zero = status_from(body(**scaling(minReplicas=0)), {"spec": {"replicas": 0}, "status": {}}, now="t")
    assert zero["phase"] == "Pending" and "autoscaler scaled to zero" in zero["conditions"][0]["message"]
    assert status_from(body(replicas=2), None, now="t")["desiredReplicas"] == 2


def test_the_gateway_example_routes_to_the_pool_the_operator_renders():
    path = Path(__file__).parents[2] / "examples" / "gateway-inferencepool.yaml"
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(path.read_text()) if doc}
    resource = {**docs["PagedLLM"], "metadata": {**docs["PagedLLM"]["metadata"], "uid": "u"}}
    pool = by_kind(render(resource, CONFIG))["InferencePool"]
    validate_manifest(pool)
    route, gateway = docs["HTTPRoute"], docs["Gateway"]
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        pool["apiVersion"].split("/")[0],
        pool["kind"],
        pool["metadata"]["name"],
    )
    assert route["spec"]["parentRefs"] == [{"name": gateway["metadata"]["name"]}]
    assert route["metadata"]["namespace"] == pool["metadata"]["namespace"] == gateway["metadata"]["namespace"]
    assert gateway["apiVersion"] == route["apiVersion"] == "gateway.networking.k8s.io/v1"


@pytest.mark.parametrize("picker", ["EPP", "9epp", "epp.svc", "x" * 64, ""])
def test_endpoint_picker_names_must_name_a_service(picker):
    with pytest.raises(SpecError, match=r"spec.routing.endpointPicker.name=.* DNS-1035 label"):
        parse_routing("spec.routing", {"inferencePool": True, "endpointPicker": {"name": picker}})


def test_a_default_endpoint_picker_name_too_long_for_a_service_is_refused():
    routing = parse_routing("spec.routing", {"inferencePool": True})
    assert endpoint_picker_name("x" * 59, routing) == "x" * 59 + "-epp"
    with pytest.raises(SpecError, match=r"'x{60}-epp' is not allowed: it names the endpoint picker's Service \(unset"):
        endpoint_picker_name("x" * 60, routing)
