"""A cluster without KEDA, the Inference Extension or the Prometheus Operator: what is applied, what is skipped.

The module's emulated cluster serves only built-in kinds (and the PagedLLM CRD); the
operator runs with its default autoscaler (HorizontalPodAutoscaler).
"""

from __future__ import annotations

import pytest
from emulated_scenario import condition, pagedllm

pytestmark = pytest.mark.k8s

SCALING = {"minReplicas": 2, "maxReplicas": 5, "metric": "queue", "target": 4, "scaleDownDelaySeconds": 60}


def test_autoscaling_applies_an_hpa_and_leaves_replicas_to_it(scenario):
    scenario.api.create(pagedllm(scenario.ns, autoscaling=SCALING))
    hpa = scenario.wait(lambda: scenario.get("HorizontalPodAutoscaler"), "the HorizontalPodAutoscaler")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "pagedllm:num_requests_waiting"
    assert hpa["metadata"]["ownerReferences"][0]["kind"] == "PagedLLM"
    budget = scenario.wait(lambda: scenario.get("PodDisruptionBudget"), "the PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1
    dep = scenario.wait_deployment()
    assert dep["spec"]["replicas"] == 1  # the API server's default: the operator does not set it
    applied = [e for e in dep["metadata"]["managedFields"] if e["manager"] == "pagedllm-operator"]
    assert applied and all("f:replicas" not in e["fieldsV1"]["f:spec"] for e in applied)

    # The autoscaler picks 3: the operator neither sets it back nor fights it, and reports it.
    scenario.api.patch("Deployment", scenario.ns, "llama", {"spec": {"replicas": 3}})
    report = {"status": {"replicas": 3, "readyReplicas": 1}}
    scenario.api.patch("Deployment", scenario.ns, "llama", report, sub="status")
    obj = scenario.wait_status(lambda s, o: s.get("desiredReplicas") == 3 and s.get("readyReplicas") == 1, "3 desired")
    assert obj["status"]["ready"] == "1/3" and obj["status"]["replicas"] == 3
    assert scenario.get("Deployment")["spec"]["replicas"] == 3
    assert not [e for e in scenario.events() if e.get("reason") == "DriftReverted"]
    ready = condition(obj, "AutoscalingReady")  # applied, but the HPA has not said it works
    assert (ready["status"], ready["reason"]) == ("False", "NotReported")


def hpa_conditions(able: str, active: str, reason: str, message: str) -> dict:
    return {
        "status": {
            "currentReplicas": 2,
            "desiredReplicas": 2,
            "conditions": [
                {"type": "AbleToScale", "status": able, "reason": "SucceededGetScale", "message": "can get scale"},
                {"type": "ScalingActive", "status": active, "reason": reason, "message": message},
            ],
        }
    }


def test_autoscaling_ready_follows_the_hpa_conditions(scenario):
    scenario.api.create(pagedllm(scenario.ns, autoscaling=SCALING))
    scenario.wait(lambda: scenario.get("HorizontalPodAutoscaler"), "the HorizontalPodAutoscaler")
    scenario.wait_status(lambda s, o: condition(o, "AutoscalingReady").get("reason") == "NotReported", "NotReported")

    # No custom metrics API (no prometheus-adapter): the HPA says it cannot read the metric.
    missing = "unable to get metric pagedllm:num_requests_waiting: no custom metrics API (custom.metrics.k8s.io)"
    report = hpa_conditions("True", "False", "FailedGetPodsMetric", missing)
    scenario.api.patch("HorizontalPodAutoscaler", scenario.ns, "llama", report, sub="status")
    obj = scenario.wait_status(
        lambda s, o: condition(o, "AutoscalingReady").get("reason") == "FailedGetPodsMetric", "FailedGetPodsMetric"
    )
    ready = condition(obj, "AutoscalingReady")
    assert ready["status"] == "False" and missing in ready["message"] and "prometheusAdapter" in ready["message"]
    assert obj["status"]["phase"] == "Pending"  # the servers are not affected

    valid = "the HPA was able to successfully calculate a replica count from pods metric pagedllm:num_requests_waiting"
    report = hpa_conditions("True", "True", "ValidMetricFound", valid)
    scenario.api.patch("HorizontalPodAutoscaler", scenario.ns, "llama", report, sub="status")
    obj = scenario.wait_status(lambda s, o: condition(o, "AutoscalingReady").get("status") == "True", "True")
    ready = condition(obj, "AutoscalingReady")
    assert ready["reason"] == "ValidMetricFound" and valid in ready["message"]

    # The HPA cannot reach the Deployment's scale subresource any more.
    report = hpa_conditions("False", "True", "ValidMetricFound", valid)
    report["status"]["conditions"][0].update(reason="FailedGetScale", message="deployments/scale forbidden")
    scenario.api.patch("HorizontalPodAutoscaler", scenario.ns, "llama", report, sub="status")
    obj = scenario.wait_status(lambda s, o: condition(o, "AutoscalingReady").get("status") == "False", "False")
    assert condition(obj, "AutoscalingReady")["reason"] == "FailedGetScale"


def test_kinds_without_their_crd_are_skipped_with_a_condition(scenario):
    scenario.api.create(pagedllm(scenario.ns, routing={"inferencePool": True}))
    scenario.wait_deployment()
    obj = scenario.wait_status(lambda s, o: condition(o, "RoutingReady"), "a RoutingReady condition")
    routing = condition(obj, "RoutingReady")
    assert (routing["status"], routing["reason"]) == ("False", "CRDNotInstalled")
    assert "inferencepools.inference.networking.k8s.io" in routing["message"]
    monitoring = condition(obj, "MonitoringReady")
    assert (monitoring["status"], monitoring["reason"]) == ("False", "CRDNotInstalled")
    assert "podmonitors.monitoring.coreos.com" in monitoring["message"]
    assert condition(obj, "Degraded")["status"] == "False" and condition(obj, "AutoscalingReady") == {}
    annotations = scenario.get("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8000"
    # nothing was sent for the kinds the cluster does not serve
    pools = f"/apis/inference.networking.k8s.io/v1/namespaces/{scenario.ns}/inferencepools"
    status, _ = scenario.api.request("GET", pools)
    assert status == 404

    # Turning routing off drops its condition; the others stay as they were.
    scenario.api.patch("PagedLLM", scenario.ns, "llama", {"spec": {"routing": {"inferencePool": False}}})
    obj = scenario.wait_status(lambda s, o: not condition(o, "RoutingReady"), "RoutingReady gone")
    assert condition(obj, "MonitoringReady")["lastTransitionTime"] == monitoring["lastTransitionTime"]


def test_scale_to_zero_without_keda_is_degraded(scenario):
    scenario.api.create(pagedllm(scenario.ns, autoscaling={**SCALING, "minReplicas": 0}))
    obj = scenario.wait_status(lambda s, o: s.get("phase") == "Degraded", "Degraded")
    degraded = condition(obj, "Degraded")
    assert degraded["reason"] == "InvalidSpec" and "scaling to zero needs KEDA" in degraded["message"]
    assert "autoscaler=keda" in degraded["message"]
    assert scenario.get("HorizontalPodAutoscaler") is None


def test_turning_autoscaling_off_deletes_the_autoscaler(scenario):
    scenario.api.create(pagedllm(scenario.ns, autoscaling=SCALING))
    scenario.wait(lambda: scenario.get("HorizontalPodAutoscaler"), "the HorizontalPodAutoscaler")
    scenario.wait(lambda: scenario.get("PodDisruptionBudget"), "the PodDisruptionBudget")
    # Off again: a HorizontalPodAutoscaler left behind would keep resizing the Deployment.
    scenario.api.patch("PagedLLM", scenario.ns, "llama", {"spec": {"autoscaling": None}})
    scenario.wait(lambda: scenario.get("HorizontalPodAutoscaler") is None, "the HorizontalPodAutoscaler deleted")
    scenario.wait(lambda: scenario.get("PodDisruptionBudget") is None, "the PodDisruptionBudget deleted (1 replica)")
    scenario.wait_deployment(lambda d: d["spec"].get("replicas") == 1, "replicas 1 again")
    # NOTE: the event is posted after the deletion it reports, so it may land a moment later
    deleted = scenario.wait(lambda: [e for e in scenario.events() if e.get("reason") == "Deleted"], "the Deleted event")
    assert "HorizontalPodAutoscaler" in deleted[0]["message"]
    obj = scenario.wait_status(lambda s, o: not condition(o, "AutoscalingReady"), "AutoscalingReady gone")
    assert condition(obj, "Degraded")["status"] == "False"


def test_a_model_over_nodes_without_the_leaderworkerset_crd_is_degraded(scenario):
    scenario.api.create(pagedllm(scenario.ns, nodes=2, tensorParallelSize=2))
    obj = scenario.wait_status(lambda s, o: condition(o, "Degraded").get("status") == "True", "Degraded")
    degraded = condition(obj, "Degraded")
    assert degraded["reason"] == "CRDNotInstalled"
    assert "leaderworkersets.leaderworkerset.x-k8s.io" in degraded["message"]
    assert condition(obj, "MultiNodeReady")["status"] == "False"
    assert scenario.get("Deployment") is None  # nothing half-runs
