"""Which fleet objects a cluster can take: API discovery, the skip, and the conditions that say so."""

from __future__ import annotations

import kubernetes
import pytest
from k8s_emulator import OPTIONAL_RESOURCE_INFOS
from resource_factories import KEDA, body

from pagedllm.operator.capabilities import servable, with_features
from pagedllm.operator.kube import DISCOVERY_TTL_SECONDS, ApiError, KubeClient
from pagedllm.operator.manifests import render

pytestmark = pytest.mark.asyncio


class FakeDiscovery:
    def __init__(self, *served: tuple[str, str]):
        self.served_kinds, self.asked = set(served), []

    async def served(self, api_version: str, kind: str) -> bool:
        self.asked.append(kind)
        return (api_version, kind) in self.served_kinds


async def test_only_served_kinds_are_kept_and_each_feature_has_an_outcome():
    manifests = render(body(routing={"inferencePool": True}, autoscaling={"maxReplicas": 2, "target": 1}), KEDA)
    discovery = FakeDiscovery(("monitoring.coreos.com/v1", "PodMonitor"))
    keep, outcomes = await servable(manifests.all(), discovery)
    assert [m["kind"] for m in keep] == ["NetworkPolicy", "Deployment", "Service", "PodDisruptionBudget", "PodMonitor"]
    assert sorted(discovery.asked) == ["InferencePool", "PodMonitor", "ScaledObject"]  # built-in kinds: never asked
    conditions = {c["type"]: c for c in (o.condition() for o in outcomes)}
    assert conditions["AutoscalingReady"]["reason"] == "CRDNotInstalled"
    assert "scaledobjects.keda.sh" in conditions["AutoscalingReady"]["message"]
    assert "KEDA" in conditions["AutoscalingReady"]["message"]
    assert conditions["RoutingReady"]["status"] == "False"
    assert conditions["MonitoringReady"] == {
        "type": "MonitoringReady",
        "status": "True",
        "reason": "Applied",
        "message": "PodMonitor llama applied",
    }


async def test_feature_conditions_keep_their_transition_time_and_go_when_not_asked_for():
    manifests = render(body(routing={"inferencePool": True}), KEDA)
    _, outcomes = await servable(manifests.all(), FakeDiscovery())
    status = {"conditions": [{"type": "Ready", "status": "False"}], "observedGeneration": 3}
    first = with_features(status, outcomes, "t1")
    again = with_features(first, outcomes, "t2")
    assert [c["type"] for c in again["conditions"]] == ["Ready", "MonitoringReady", "RoutingReady"]
    assert all(c.get("lastTransitionTime") in (None, "t1") for c in again["conditions"])
    assert again["conditions"][1]["observedGeneration"] == 3
    _, fewer = await servable(render(body(), KEDA).all(), FakeDiscovery(("monitoring.coreos.com/v1", "PodMonitor")))
    flipped = with_features(again, fewer, "t3")
    assert [c["type"] for c in flipped["conditions"]] == ["Ready", "MonitoringReady"]
    assert flipped["conditions"][1]["lastTransitionTime"] == "t3"  # False -> True


@pytest.mark.k8s
async def test_kube_client_discovers_served_kinds_and_remembers_for_a_while(cluster):
    now = [0.0]

    def configure() -> kubernetes.client.Configuration:
        return kubernetes.client.Configuration(host=cluster.url, api_key={"BearerToken": "Bearer t"})

    kube = KubeClient(configure, clock=lambda: now[0])
    try:
        assert await kube.served("apps/v1", "Deployment")
        assert not await kube.served("apps/v1", "Deploymentx")
        assert not await kube.served("keda.sh/v1alpha1", "ScaledObject")
        asked = len(cluster.operator_requests())
        cluster.install(OPTIONAL_RESOURCE_INFOS)
        assert not await kube.served("keda.sh/v1alpha1", "ScaledObject")  # remembered
        assert len(cluster.operator_requests()) == asked
        now[0] += DISCOVERY_TTL_SECONDS + 1
        assert await kube.served("keda.sh/v1alpha1", "ScaledObject")
        assert await kube.served("inference.networking.k8s.io/v1", "InferencePool")
    finally:
        await kube.close()


async def test_kube_client_logs_in_again_once_after_a_401_then_gives_up(cluster):
    logins = []

    def configure() -> kubernetes.client.Configuration:
        logins.append(1)
        return kubernetes.client.Configuration(host=cluster.url, api_key={"BearerToken": "Bearer t"})

    path = "/api/v1/namespaces/unauthorized/services/llama"
    cluster.refuse("GET", path, 401, "Unauthorized")
    kube = KubeClient(configure)
    try:
        with pytest.raises(ApiError) as refused:
            await kube.get("Service", "unauthorized", "llama")
    finally:
        await kube.close()
    assert (refused.value.status, refused.value.retriable) == (401, False)
    assert len(logins) == 2  # the token may have rotated: loaded again once, not in a loop
    assert sum(1 for r in cluster.operator_requests() if r.url.path == path) == 2


async def test_kube_client_applies_under_the_field_manager_asked_for(cluster):
    def configure() -> kubernetes.client.Configuration:
        return kubernetes.client.Configuration(host=cluster.url, api_key={"BearerToken": "Bearer t"})

    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "managers"}, "spec": {}}
    kube = KubeClient(configure)
    try:
        await kube.apply(service)
        await kube.apply(service, field_manager="pagedllm-operator-handover")
    finally:
        await kube.close()
    path = "/api/v1/namespaces/managers/services/s"
    applies = [r.params for r in cluster.operator_requests() if r.method.value == "PATCH" and r.url.path == path]
    assert [(p.get("fieldManager"), p.get("force")) for p in applies] == [
        ("pagedllm-operator", "true"),
        ("pagedllm-operator-handover", "true"),
    ]
