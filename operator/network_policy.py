"""Rendering ``spec.networkPolicy``: who may connect to a resource's pods, and where they may connect.

::

    NetworkPolicy NAME                  the server pods (a LeaderWorkerSet's leaders and workers too)
      ingress  spec.port (TCP)          from networkPolicy.apiClients; unset: every pod of the namespace
                                        (ClusterIP), or any source (NodePort, LoadBalancer: meant to be
                                        reached from outside, behind apiKeySecret); plus the deployed
                                        endpoint picker's pods and the namespaces the admin allows
                                        (--network-policy-namespace: Prometheus, a Gateway's proxies)
      ingress  every port               (spec.nodes > 1) from the resource's own server pods: the engine's
                                        channel (29501), torch.distributed's store (29502) and the sockets
                                        NCCL and gloo open on ports of their choosing
      egress   DNS; (spec.nodes > 1) the resource's own server pods. Not restricted where the pods
               download the model themselves (fetch-model: no modelCache)
    NetworkPolicy NAME-model-download   the model-cache Job's pods: no ingress, egress unrestricted

NOTE: a NetworkPolicy selects pods, not containers. A fetch-model init container shares its pod
with the server, so where it downloads, the server's egress stays open too; with
``spec.modelCache`` the download runs in a Job's pods of their own, and the servers may reach
nothing but DNS (and their group's other pods). Likewise "only between a group's pods" is
"only between the resource's server pods": a policy's selectors cannot refer to the receiving
pod's own group (``leaderworkerset.sigs.k8s.io/group-index``), and every group of a resource
runs the same image, model and configuration.

NetworkPolicies are additive: another policy selecting these pods can only allow more. They are
enforced only where the cluster's network plugin implements them (Calico, Cilium, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.operator.spec_fields import SpecError, _mapping, _object_list

if TYPE_CHECKING:
    from pagedllm.operator.spec import PagedLLMSpec

API_VERSION = "networking.k8s.io/v1"
KIND = "NetworkPolicy"
DOWNLOAD_SUFFIX = "-model-download"
PEER_KEYS = ("podSelector", "namespaceSelector", "ipBlock")
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace
DNS_PORTS = ({"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53})
OPERATOR_POD_LABELS = {"app.kubernetes.io/component": "operator"}  # the chart's (a test checks it)


@dataclass(frozen=True)
class NetworkPolicySettings:
    """``spec.networkPolicy``: whether the operator fences the pods, and who may call the API."""

    enabled: bool = True
    """Render the policies; off leaves the pods as open as the namespace's own policies make them."""
    api_clients: tuple[dict, ...] | None = None
    """NetworkPolicyPeers that may reach the API port; ``None``: the default (see the module)."""


def parse_network_policy(path: str, value: Any) -> NetworkPolicySettings:
    value = _mapping(path, value)
    unknown = sorted(set(value) - {"enabled", "apiClients"})
    if unknown:
        raise SpecError(f"{path} has unknown field(s) {unknown}: allowed are ['apiClients', 'enabled']")
    enabled = value.get("enabled", True)
    if not isinstance(enabled, bool):
        raise SpecError(f"{path}.enabled={enabled!r} has the wrong type: must be a boolean")
    clients = value.get("apiClients")
    if clients is None:
        return NetworkPolicySettings(enabled=enabled)
    peers = _object_list(f"{path}.apiClients", clients)
    if not peers:
        # NOTE: an empty `from` in a NetworkPolicy rule admits every source: never render one.
        raise SpecError(
            f"{path}.apiClients=[] is not allowed: list at least one peer, or leave it unset (the namespace's pods)"
        )
    for index, peer in enumerate(peers):
        if not peer or set(peer) - set(PEER_KEYS):
            raise SpecError(
                f"{path}.apiClients[{index}]={peer!r} is not allowed: a NetworkPolicyPeer with "
                f"{', '.join(PEER_KEYS)} only"
            )
    return NetworkPolicySettings(enabled=enabled, api_clients=peers)


def download_policy_name(name: str) -> str:
    return f"{name}{DOWNLOAD_SUFFIX}"


def render_network_policies(
    name: str,
    spec: PagedLLMSpec,
    server_pods: Mapping[str, str],
    download_pods: Mapping[str, str] | None,
    picker_pods: Mapping[str, str] | None,
    namespaces: tuple[str, ...] = (),
    operator_namespace: str | None = None,
) -> tuple[dict, ...]:
    """The policies of the resource ``name``: its server pods' (matched by ``server_pods``), and its
    download Job pods' (``download_pods``, ``None`` without a Job). ``picker_pods`` (the deployed
    endpoint picker's labels) and the pods of ``namespaces`` (the admin's) may always reach the API port, and
    with LoRA on so may the operator's pods in ``operator_namespace`` (they load adapters through it)."""
    always = [{"podSelector": {"matchLabels": dict(picker_pods)}}] if picker_pods is not None else []
    always += [{"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: ns}}} for ns in namespaces]
    if operator_namespace is not None and spec.lora_enabled:
        selector = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: operator_namespace}}}
        always.append({**selector, "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}})
    policies = [_server_policy(name, spec, server_pods, always)]
    if download_pods is not None:
        policies.append(_download_policy(name, download_pods))
    return tuple(policies)


def _server_policy(name: str, spec: PagedLLMSpec, server_pods: Mapping[str, str], always: list[dict]) -> dict:
    own = {"podSelector": {"matchLabels": dict(server_pods)}}
    api: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": spec.port}]}
    peers = _api_peers(spec, always)
    if peers is not None:
        api["from"] = peers
    ingress = [api]
    egress: list[dict] = [{"ports": [dict(p) for p in DNS_PORTS]}]
    if spec.nodes > 1:
        ingress.append({"from": [own]})
        egress.append({"to": [own]})
    # NOTE: where fetch-model runs in the pod, the pod needs the download's egress (see the module).
    closed_egress = not (spec.downloads and spec.model_cache is None)
    policy_spec: dict[str, Any] = {
        "podSelector": {"matchLabels": dict(server_pods)},
        "policyTypes": ["Ingress", "Egress"] if closed_egress else ["Ingress"],
        "ingress": ingress,
    }
    if closed_egress:
        policy_spec["egress"] = egress
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": policy_spec}


def _api_peers(spec: PagedLLMSpec, always: list[dict]) -> list[dict] | None:
    """Who may reach the API port; ``None``: any source."""
    clients = spec.network_policy.api_clients
    if clients is None and spec.is_public:
        return None  # NOTE: a NodePort or LoadBalancer Service is there to be reached from outside
    if clients is None:  # every pod of the namespace (the picker's among them), and the admin's namespaces
        return [{"podSelector": {}}] + [p for p in always if "namespaceSelector" in p]
    return [dict(p) for p in clients] + always


def _download_policy(name: str, download_pods: Mapping[str, str]) -> dict:
    """Nothing connects to a download; it may connect anywhere (the Hub, S3, GCS, a proxy)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": download_policy_name(name)},
        "spec": {"podSelector": {"matchLabels": dict(download_pods)}, "policyTypes": ["Ingress"], "ingress": []},
    }
