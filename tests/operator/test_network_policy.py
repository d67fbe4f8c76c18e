"""The NetworkPolicies a PagedLLM renders to (pure functions): who may connect, and where to."""

from __future__ import annotations

import asyncio

import pytest
from resource_factories import CONFIG, body
from test_drift import DeletingKube, owned, resource
from third_party_schemas import validate_manifest

from pagedllm.operator.apply import ApplyOutcome, prune
from pagedllm.operator.leaderworkerset import MASTER_PORT
from pagedllm.operator.manifests import RenderConfig, render
from pagedllm.operator.spec import SpecError

SERVERS = {
    "app.kubernetes.io/name": "pagedllm",
    "app.kubernetes.io/instance": "llama",
    "app.kubernetes.io/component": "server",
}
DOWNLOADS = {
    "app.kubernetes.io/name": "pagedllm-model-download",
    "app.kubernetes.io/instance": "llama",
    "app.kubernetes.io/component": "model-download",
    "app.kubernetes.io/managed-by": "pagedllm-operator",
}
DNS = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
CACHE = {"modelCache": {"size": "100Gi", "accessMode": "ReadWriteMany"}}


def policies(**spec) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in render(body(**spec), CONFIG).network_policies}


def test_the_api_port_is_open_to_the_namespace_and_egress_is_dns_only_with_a_cache_job():
    found = policies(**CACHE)
    assert sorted(found) == ["llama", "llama-model-download"]
    assert found["llama"]["spec"] == {
        "podSelector": {"matchLabels": SERVERS},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [{"ports": [{"protocol": "TCP", "port": 8000}], "from": [{"podSelector": {}}]}],
        "egress": [DNS],
    }
    # Nothing connects to a download; it may reach the Hub or a bucket (no Egress type).
    assert found["llama-model-download"]["spec"] == {
        "podSelector": {"matchLabels": DOWNLOADS},
        "policyTypes": ["Ingress"],
        "ingress": [],
    }
    for policy in found.values():
        assert policy["metadata"]["ownerReferences"][0]["kind"] == "PagedLLM"
        validate_manifest(policy)


def test_the_download_pods_are_outside_every_server_selector():
    m = render(body(**CACHE), CONFIG)
    pod_labels = m.job["spec"]["template"]["metadata"]["labels"]
    assert pod_labels == DOWNLOADS
    for selector in (m.service["spec"]["selector"], SERVERS, m.deployment["spec"]["selector"]["matchLabels"]):
        assert not selector.items() <= pod_labels.items()
    assert SERVERS.items() <= m.deployment["spec"]["template"]["metadata"]["labels"].items()


def test_pods_that_download_for_themselves_keep_their_egress():
    """fetch-model shares the server's pod: a NetworkPolicy selects pods, not containers."""
    (policy,) = policies().values()
    assert policy["spec"]["policyTypes"] == ["Ingress"] and "egress" not in policy["spec"]


@pytest.mark.parametrize(
    "spec", [{"modelSource": {"type": "pvc", "pvc": {"claimName": "weights"}}}, {"model": "/opt/model"}]
)
def test_servers_that_download_nothing_reach_dns_only(spec):
    (policy,) = policies(**spec).values()
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"] and policy["spec"]["egress"] == [DNS]


def test_api_clients_replace_the_namespace_and_the_deployed_picker_is_always_let_in():
    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
    prometheus = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "prometheus"}}}
    spec = {"networkPolicy": {"apiClients": [gateway, prometheus]}, "port": 9000}
    (policy,) = policies(**spec).values()
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 9000}], "from": [gateway, prometheus]}]
    routing = {"inferencePool": True, "endpointPicker": {"deploy": True}}
    (policy,) = policies(**spec, routing=routing).values()
    picker = {"app.kubernetes.io/name": "pagedllm-endpoint-picker", "app.kubernetes.io/instance": "llama"}
    assert policy["spec"]["ingress"][0]["from"] == [gateway, prometheus, {"podSelector": {"matchLabels": picker}}]


@pytest.mark.parametrize("service_type", ["NodePort", "LoadBalancer"])
def test_a_public_service_is_reachable_from_any_source_unless_clients_are_listed(service_type):
    public = {"serviceType": service_type, "apiKeySecret": {"name": "keys"}}
    (policy,) = policies(**public).values()
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]  # no `from`: any source
    office = {"ipBlock": {"cidr": "203.0.113.0/24"}}
    (policy,) = policies(**public, networkPolicy={"apiClients": [office]}).values()
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}], "from": [office]}]


def test_a_groups_ports_are_open_only_to_the_resources_own_server_pods():
    m = render(body(nodes=2, tensorParallelSize=8, **CACHE), CONFIG)
    (policy, _download) = m.network_policies
    own = {"podSelector": {"matchLabels": SERVERS}}
    assert policy["spec"] == {
        "podSelector": {"matchLabels": SERVERS},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [{"ports": [{"protocol": "TCP", "port": 8000}], "from": [{"podSelector": {}}]}, {"from": [own]}],
        "egress": [DNS, {"to": [own]}],
    }
    # The policy selects leaders and workers alike, whose ports (tp 29501) the group uses.
    templates = m.deployment["spec"]["leaderWorkerTemplate"]
    for template in (templates["leaderTemplate"], templates["workerTemplate"]):
        assert SERVERS.items() <= template["metadata"]["labels"].items()
    leader_ports = templates["leaderTemplate"]["spec"]["containers"][0]["ports"]
    assert {"name": "tp", "containerPort": MASTER_PORT, "protocol": "TCP"} in leader_ports


def test_policies_can_be_turned_off_per_resource_and_operator_wide():
    assert render(body(networkPolicy={"enabled": False}, **CACHE), CONFIG).network_policies == ()
    off = RenderConfig(default_image="img", network_policies=False)
    m = render(body(**CACHE), off)
    assert m.network_policies == () and "NetworkPolicy" not in [o["kind"] for o in m.all()]


@pytest.mark.parametrize(
    "network_policy, message",
    [
        ({"apiClients": []}, r"spec.networkPolicy.apiClients=\[\] is not allowed: list at least one peer"),
        ({"apiClients": [{}]}, r"spec.networkPolicy.apiClients\[0\]=\{\} is not allowed: a NetworkPolicyPeer"),
        ({"apiClients": [{"ports": [80]}]}, r"apiClients\[0\]=\{'ports': \[80\]\} is not allowed"),
        ({"enabled": "yes"}, r"spec.networkPolicy.enabled='yes' has the wrong type"),
        ({"from": []}, r"spec.networkPolicy has unknown field\(s\) \['from'\]"),
    ],
)
def test_invalid_settings_are_refused(network_policy, message):
    with pytest.raises(SpecError, match=message):
        render(body(networkPolicy=network_policy), CONFIG)


def test_policies_turned_off_are_deleted_when_the_resources_own():
    live = {"NetworkPolicy": owned("np-uid")}
    kube = DeletingKube(live=live)
    outcome = ApplyOutcome()
    rendered = render(resource(networkPolicy={"enabled": False}, **CACHE), CONFIG).all()
    asyncio.run(prune(rendered, kube, "owner-uid", outcome))
    assert kube.deleted == [
        ("NetworkPolicy", "ns", "llama", "np-uid"),
        ("NetworkPolicy", "ns", "llama-model-download", "np-uid"),
    ]
    assert outcome.deleted == ["NetworkPolicy", "NetworkPolicy"] and outcome.problem() is None
    kube = DeletingKube(live=live)
    asyncio.run(prune(render(resource(**CACHE), CONFIG).all(), kube, "owner-uid", ApplyOutcome()))
    assert kube.deleted == []
    kube = DeletingKube(live=live)  # no cache Job any more: only its policy goes
    asyncio.run(prune(render(resource(), CONFIG).all(), kube, "owner-uid", ApplyOutcome()))
    assert kube.deleted == [("NetworkPolicy", "ns", "llama-model-download", "np-uid")]


def test_the_admins_namespaces_may_always_reach_the_api_port():
    config = RenderConfig(default_image="img", network_policy_namespaces=("monitoring", "gateway-system"))
    allowed = [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway-system"}}},
    ]
    (policy,) = render(body(), config).network_policies
    assert policy["spec"]["ingress"][0]["from"] == [{"podSelector": {}}, *allowed]
    office = {"ipBlock": {"cidr": "203.0.113.0/24"}}
    (policy,) = render(body(networkPolicy={"apiClients": [office]}), config).network_policies
    assert policy["spec"]["ingress"][0]["from"] == [office, *allowed]
    public = body(serviceType="LoadBalancer", apiKeySecret={"name": "k"})
    (policy,) = render(public, config).network_policies
    assert "from" not in policy["spec"]["ingress"][0]  # any source already


def test_the_operator_may_reach_the_api_port_only_with_lora_on():
    from pagedllm.operator.network_policy import OPERATOR_POD_LABELS

    config = RenderConfig(default_image="img", operator_namespace="pagedllm-system")
    peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "pagedllm-system"}},
        "podSelector": {"matchLabels": OPERATOR_POD_LABELS},
    }
    clients = {"networkPolicy": {"apiClients": [{"podSelector": {"matchLabels": {"app": "web"}}}]}}
    with_lora = render(body(model="org/m", enableLora=True, **clients), config).network_policies[0]
    assert peer in with_lora["spec"]["ingress"][0]["from"]
    without = render(body(model="org/m", **clients), config).network_policies[0]
    assert peer not in without["spec"]["ingress"][0]["from"]
