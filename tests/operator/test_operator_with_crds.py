"""A cluster with KEDA, the Gateway API Inference Extension and the Prometheus Operator installed.

The module's emulated cluster serves their kinds before the operator starts, and the
operator runs with ``--autoscaler keda`` (the chart's ``autoscaler=keda``).
"""

from __future__ import annotations

import pytest
from emulated_scenario import condition, emulated_cluster, pagedllm
from helm_tools import rules_of
from k8s_emulator import OPTIONAL_RESOURCE_INFOS
from operator_process import running_operator

pytestmark = pytest.mark.k8s

PROMETHEUS = "http://prometheus.monitoring.svc:9090"


@pytest.fixture(scope="module")
def cluster(chart_policy):
    with emulated_cluster(chart_policy("--set", "autoscaler=keda")) as emulated:
        emulated.install(OPTIONAL_RESOURCE_INFOS)
        yield emulated


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    args = ("--autoscaler", "keda", "--prometheus-address", PROMETHEUS)
    with running_operator(cluster, tmp_path_factory.mktemp("operator"), extra_args=args) as handle:
        yield handle


def test_scaled_object_inference_pool_and_pod_monitor_are_applied(scenario):
    scaling = {"minReplicas": 0, "maxReplicas": 3, "metric": "kvCache", "target": 0.7}
    scenario.api.create(pagedllm(scenario.ns, autoscaling=scaling, routing={"inferencePool": True}))
    scaled = scenario.wait(lambda: scenario.get("ScaledObject"), "the ScaledObject")
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (0, 3)
    meta = scaled["spec"]["triggers"][0]["metadata"]
    assert meta["serverAddress"] == PROMETHEUS and meta["threshold"] == "0.7"
    assert f'pagedllm:kv_cache_usage_perc{{namespace="{scenario.ns}"' in meta["query"]
    pool = scenario.wait(lambda: scenario.get("InferencePool"), "the InferencePool")
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    monitor = scenario.wait(lambda: scenario.get("PodMonitor"), "the PodMonitor")
    dep = scenario.wait_deployment()
    for obj in (scaled, pool, monitor):
        assert obj["metadata"]["ownerReferences"][0]["kind"] == "PagedLLM"
    assert pool["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert monitor["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert scenario.get("HorizontalPodAutoscaler") is None  # KEDA makes its own

    # Applied is not working: KEDA has not said Ready, no Gateway took the pool, no picker runs.
    obj = scenario.wait_status(lambda s, o: condition(o, "RoutingReady"), "feature conditions")
    assert condition(obj, "AutoscalingReady")["status"] == "False"
    assert (condition(obj, "RoutingReady")["status"], condition(obj, "RoutingReady")["reason"]) == (
        "False",
        "NotAccepted",
    )
    report_ready(scenario)
    obj = scenario.wait_status(
        lambda s, o: all(condition(o, c).get("status") == "True" for c in ("AutoscalingReady", "RoutingReady")),
        "feature conditions True",
    )
    assert condition(obj, "MonitoringReady")["reason"] == "Applied"

    # KEDA scales to zero: a Pending phase that says so, not an error.
    scenario.api.patch("Deployment", scenario.ns, "llama", {"spec": {"replicas": 0}})
    obj = scenario.wait_status(lambda s, o: s.get("desiredReplicas") == 0, "scaled to zero")
    assert obj["status"]["phase"] == "Pending" and condition(obj, "Ready")["reason"] == "ScaledToZero"


def picker_slice(namespace: str, service: str, ready: bool) -> dict:
    """An EndpointSlice as the EndpointSlice controller writes it for the picker's Service."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-abcde",
            "namespace": namespace,
            "labels": {
                "kubernetes.io/service-name": service,
                "app.kubernetes.io/managed-by": "pagedllm-operator",
                "app.kubernetes.io/instance": "llama",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.0.0.7"], "conditions": {"ready": ready}}],
        "ports": [{"name": "grpc", "port": 9002, "protocol": "TCP"}],
    }


SINCE = {"lastTransitionTime": "2026-01-01T00:00:00Z"}


def accepted_by(gateway: str, accepted: str = "True", resolved: str = "True") -> dict:
    return {
        "status": {
            "parents": [
                {
                    "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway},
                    "conditions": [  # metav1.Condition: the pool's CRD requires each field
                        {"type": "Accepted", "status": accepted, "reason": "Accepted", "message": "", **SINCE},
                        {
                            "type": "ResolvedRefs",
                            "status": resolved,
                            "reason": "ResolvedRefs",
                            "message": "refs",
                            **SINCE,
                        },
                    ],
                }
            ]
        }
    }


def report_ready(scenario) -> None:
    """KEDA says the ScaledObject is Ready, a Gateway accepted the pool, the picker has a ready pod."""
    scenario.api.create(picker_slice(scenario.ns, "llama-epp", ready=True))
    ready = {"type": "Ready", "status": "True", "reason": "ScaledObjectReady", "message": "ScaledObject is defined"}
    scenario.api.patch("ScaledObject", scenario.ns, "llama", {"status": {"conditions": [ready]}}, sub="status")
    scenario.api.patch("InferencePool", scenario.ns, "llama", accepted_by("inference-gateway"), sub="status")


def test_routing_ready_follows_the_pool_parents_and_the_picker_endpoints(scenario):
    scenario.api.create(pagedllm(scenario.ns, routing={"inferencePool": True}))
    scenario.wait(lambda: scenario.get("InferencePool"), "the InferencePool")
    scenario.api.create(picker_slice(scenario.ns, "llama-epp", ready=False))
    scenario.api.patch("InferencePool", scenario.ns, "llama", accepted_by("gw"), sub="status")
    obj = scenario.wait_status(
        lambda s, o: condition(o, "RoutingReady").get("reason") == "EndpointPickerUnavailable", "no ready picker"
    )
    assert "llama-epp has no ready endpoint" in condition(obj, "RoutingReady")["message"]

    # The picker's pod gets ready: its slice says so, and the resource follows.
    ready = {"endpoints": [{"addresses": ["10.0.0.7"], "conditions": {"ready": True}}]}
    scenario.api.patch("EndpointSlice", scenario.ns, "llama-epp-abcde", ready)
    obj = scenario.wait_status(lambda s, o: condition(o, "RoutingReady").get("status") == "True", "RoutingReady")
    assert "accepted by gw" in condition(obj, "RoutingReady")["message"]

    # The Gateway cannot resolve the picker reference any more.
    scenario.api.patch("InferencePool", scenario.ns, "llama", accepted_by("gw", resolved="False"), sub="status")
    obj = scenario.wait_status(lambda s, o: condition(o, "RoutingReady").get("status") == "False", "unresolved")
    assert (
        condition(obj, "RoutingReady")["reason"] == "ResolvedRefs"
        and "Gateway gw" in condition(obj, "RoutingReady")["message"]
    )


def test_the_operator_deploys_the_endpoint_picker_and_routing_follows_it(scenario):
    routing = {"inferencePool": True, "endpointPicker": {"deploy": True}}
    created = scenario.api.create(pagedllm(scenario.ns, routing=routing))
    picker = scenario.wait(lambda: scenario.get("Deployment", "llama-epp"), "the picker's Deployment")
    for kind in ("Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget"):
        obj = scenario.wait(lambda kind=kind: scenario.get(kind, "llama-epp"), f"the picker's {kind}")
        assert obj["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    # Highly available: two pickers on different nodes where possible, one drained at a time.
    assert picker["spec"]["replicas"] == 2
    assert "podAntiAffinity" in picker["spec"]["template"]["spec"]["affinity"]
    budget = scenario.get("PodDisruptionBudget", "llama-epp")
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"] == picker["spec"]["selector"]["matchLabels"]
    args = picker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-namespace") + 1] == scenario.ns
    server = scenario.wait_deployment()
    assert server["spec"]["template"]["spec"]["containers"][0]["name"] == "server"  # not taken for the picker
    # The picker's pod gets ready (its Service's slice says so) and a Gateway takes the pool.
    scenario.api.create(picker_slice(scenario.ns, "llama-epp", ready=True))
    scenario.api.patch("InferencePool", scenario.ns, "llama", accepted_by("gw"), sub="status")
    scenario.wait_status(lambda s, o: condition(o, "RoutingReady").get("status") == "True", "RoutingReady")
    # Deleted by hand: back.
    scenario.api.delete("Deployment", scenario.ns, "llama-epp")
    scenario.wait(lambda: scenario.get("Deployment", "llama-epp"), "the picker recreated")


def test_routing_and_autoscaling_turned_off_delete_their_objects(scenario):
    scaling = {"minReplicas": 1, "maxReplicas": 3, "metric": "queue", "target": 2}
    scenario.api.create(pagedllm(scenario.ns, autoscaling=scaling, routing={"inferencePool": True}))
    scenario.wait(lambda: scenario.get("ScaledObject") and scenario.get("InferencePool"), "the fleet objects")
    scenario.api.patch("PagedLLM", scenario.ns, "llama", {"spec": {"autoscaling": None, "routing": None}})
    scenario.wait(lambda: scenario.get("ScaledObject") is None, "the ScaledObject deleted")
    scenario.wait(lambda: scenario.get("InferencePool") is None, "the InferencePool deleted")
    assert scenario.get("PodMonitor") is not None  # still asked for


def test_chart_rbac_with_keda_grants_every_call_the_operator_made(cluster, helm_template):
    flags = ("--set", "autoscaler=keda", "--set", "clusterWide=true")
    (role,) = [doc for doc in helm_template(*flags) if doc["kind"] == "ClusterRole"]
    granted, used = rules_of(role), cluster.operator_rbac_calls()
    assert used - granted == set(), f"calls the chart's RBAC does not allow: {sorted(used - granted)}"
    assert {
        ("keda.sh", "scaledobjects", "patch"),
        ("inference.networking.k8s.io", "inferencepools", "patch"),
        ("monitoring.coreos.com", "podmonitors", "patch"),
        ("keda.sh", "scaledobjects", "delete"),
    } <= used


def test_a_model_over_two_nodes_is_a_leaderworkerset_with_leaders_behind_the_service(scenario):
    from test_leaderworkerset import lws_validator

    scenario.api.create(pagedllm(scenario.ns, nodes=2, tensorParallelSize=2, routing={"inferencePool": True}))
    lws = scenario.wait(lambda: scenario.get("LeaderWorkerSet"), "the LeaderWorkerSet")
    served = {k: v for k, v in lws.items() if k != "status"}
    errors = [e.message for e in lws_validator().iter_errors(served)]
    assert not errors, errors[:5]
    assert lws["metadata"]["ownerReferences"][0]["kind"] == "PagedLLM"
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert scenario.get("Deployment") is None
    service = scenario.wait(lambda: scenario.get("Service"), "the Service")
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    pool = scenario.wait(lambda: scenario.get("InferencePool"), "the InferencePool")
    assert pool["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    obj = scenario.wait_status(lambda s, o: condition(o, "MultiNodeReady"), "a MultiNodeReady condition")
    assert condition(obj, "MultiNodeReady")["status"] == "True"
    assert condition(obj, "Degraded").get("status") != "True"

    # The groups' readiness reaches the resource through the LeaderWorkerSet's events.
    generation = lws["metadata"].get("generation")
    report = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
    report.update({"observedGeneration": generation} if generation else {})
    scenario.api.patch("LeaderWorkerSet", scenario.ns, "llama", {"status": report}, sub="status")
    obj = scenario.wait_status(lambda s, o: s.get("phase") == "Ready", "Ready from the LeaderWorkerSet")
    assert obj["status"]["ready"] == "1/1"

    # Deleted by hand: recreated from its event.
    uid = lws["metadata"]["uid"]
    scenario.api.delete("LeaderWorkerSet", scenario.ns, "llama")
    scenario.wait(
        lambda: (scenario.get("LeaderWorkerSet") or {}).get("metadata", {}).get("uid") not in (None, uid),
        "a new LeaderWorkerSet",
    )

    # Back to one node: the Deployment returns and the operator's LeaderWorkerSet is deleted.
    scenario.api.patch("PagedLLM", scenario.ns, "llama", {"spec": {"nodes": 1}})
    scenario.wait_deployment()
    scenario.wait(lambda: scenario.get("LeaderWorkerSet") is None or None, "the LeaderWorkerSet deleted")


def managers_of_replicas(obj: dict) -> set[str]:
    return {
        entry["manager"]
        for entry in obj["metadata"].get("managedFields") or []
        if "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {})
    }


@pytest.mark.parametrize("kind, spec", [("LeaderWorkerSet", {"nodes": 2}), ("Deployment", {})], ids=["lws", "dep"])
def test_autoscaling_on_keeps_replicas_under_ssa(scenario, kind, spec):
    """The emulator removes a field whose only manager stops applying it (as an API server does): without
    the hand-over the fleet of 3 would lose spec.replicas (and fall to the default of 1)."""
    scenario.api.create(pagedllm(scenario.ns, replicas=3, **spec))
    # NOTE: long waits: by now this module's operator reconciles every earlier test's resources too
    workload = scenario.wait(lambda: scenario.get(kind), kind, timeout=90)
    assert workload["spec"]["replicas"] == 3 and managers_of_replicas(workload) == {"pagedllm-operator"}

    scaling = {"minReplicas": 2, "maxReplicas": 6, "metric": "queue", "target": 4}
    scenario.api.patch("PagedLLM", scenario.ns, "llama", {"spec": {"replicas": None, "autoscaling": scaling}})
    scenario.wait(lambda: scenario.get("ScaledObject"), "the ScaledObject", timeout=90)
    handed = scenario.wait(
        lambda: (w := scenario.get(kind)) and managers_of_replicas(w) == {"pagedllm-operator-handover"} and w,
        "the replicas handed over",
        timeout=90,
    )
    assert handed["spec"]["replicas"] == 3

    # The autoscaler (through /scale) takes the field; the operator's re-applies leave it alone.
    scenario.api.patch(kind, scenario.ns, "llama", {"spec": {"replicas": 5}}, sub="scale")
    changed = scenario.api.patch("PagedLLM", scenario.ns, "llama", {"spec": {"seed": 1}})
    generation = str(changed["metadata"]["generation"])
    scenario.wait(
        lambda: scenario.get(kind)["metadata"]["annotations"].get("pagedllm.dev/generation") == generation or None,
        "the new generation applied",
        timeout=90,
    )
    assert scenario.get(kind)["spec"]["replicas"] == 5
