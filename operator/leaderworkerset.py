"""Replicas larger than one node: ``spec.nodes > 1`` renders a LeaderWorkerSet instead of the Deployment.

::

    LeaderWorkerSet NAME  (replicas = spec.replicas, one group per replica)
      group i: size = spec.nodes pods, each with tensorParallelSize GPUs
        leader (worker-index 0)   pagedllm serve ... --nnodes N --node-rank 0 --master-addr $(LWS_LEADER_ADDRESS)
                                  the engine, the HTTP API, readiness; the Service selects only leaders
        worker (worker-index k)   pagedllm serve --headless ... --node-rank $(LWS_WORKER_INDEX)
                                  ranks k*T .. k*T+T-1 only: no port, no probes

The engine's tensor-parallel size is ``tensorParallelSize x nodes``: tensor parallelism spans
the group's pods, the engine's channel and torch.distributed meet on the leader's
:data:`MASTER_PORT` (and the next port). ``RecreateGroupOnPodRestart``: a lost pod breaks
its group's collectives, so the whole group starts again; the server's own failure handling
(a rank that goes away ends the leader, a leader that goes away ends every worker) makes
that happen quickly.

NOTE: built from the rendered Deployment (its pod template is the leader's), so every pod
setting a Deployment gets (volumes, security, placement, env) reaches both templates with
no second copy of the pod rendering.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from pagedllm.operator.spec import PagedLLMSpec, SpecError
from pagedllm.server.args import flag_for

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
MASTER_PORT = 29501
LEADER_ONLY = {WORKER_INDEX_LABEL: "0"}
"""Added to the Service's (and the InferencePool's, the PodMonitor's, the disruption budget's) selector."""


def wants_leaderworkerset(spec: PagedLLMSpec) -> bool:
    return spec.nodes > 1


def check_nodes(spec: PagedLLMSpec) -> None:
    """Refuse a spec whose replicas cannot span nodes."""
    if spec.nodes > 1 and spec.tensor_parallel_size * spec.nodes > 64:
        raise SpecError(
            f"spec.nodes={spec.nodes} is not allowed: tensorParallelSize x nodes must be at most 64 ranks"
            f" (here {spec.tensor_parallel_size * spec.nodes})"
        )


def node_args(args: list[str], spec: PagedLLMSpec, worker: bool) -> list[str]:
    """The server's arguments for a pod of a group: the whole group's tensor-parallel size, its place in it."""
    args = list(args)
    tp = flag_for("tensor_parallel_size")
    at = args.index(tp)
    args[at + 1] = str(spec.tensor_parallel_size * spec.nodes)
    rank = "$(LWS_WORKER_INDEX)" if worker else "0"
    layout = [
        flag_for("nnodes"), "$(LWS_GROUP_SIZE)",
        flag_for("node_rank"), rank,
        flag_for("master_addr"), "$(LWS_LEADER_ADDRESS)",
        flag_for("master_port"), str(MASTER_PORT),
    ]  # fmt: skip
    return (["--headless"] if worker else []) + args + layout


def render_leaderworkerset(deployment: dict, spec: PagedLLMSpec) -> dict:
    """The LeaderWorkerSet that runs what ``deployment`` would, each replica spread over ``spec.nodes`` pods."""
    template = deployment["spec"]["template"]
    lws_spec: dict[str, Any] = {
        "startupPolicy": "LeaderCreated",
        "rolloutStrategy": _rollout(spec),
        "leaderWorkerTemplate": {
            "size": spec.nodes,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": _leader(template, spec),
            "workerTemplate": _worker(template, spec),
        },
    }
    if "replicas" in deployment["spec"]:  # NOTE: left out under an autoscaler, as for the Deployment
        lws_spec = {"replicas": deployment["spec"]["replicas"], **lws_spec}
    metadata = copy.deepcopy(deployment["metadata"])
    metadata["annotations"] = {**metadata.get("annotations", {}), **spec.group_placement.annotations()}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": lws_spec}


def _rollout(spec: PagedLLMSpec) -> dict:
    """The Deployment's rollout plan, over groups: LWS only rolls, so Recreate is every group at once."""
    plan = spec.rollout_plan
    if plan.type == "Recreate":
        config: dict[str, Any] = {"maxUnavailable": "100%", "maxSurge": 0}
    else:
        config = {"maxUnavailable": plan.max_unavailable, "maxSurge": plan.max_surge}
    return {"type": "RollingUpdate", "rollingUpdateConfiguration": config}


def _leader(template: dict, spec: PagedLLMSpec) -> dict:
    leader = copy.deepcopy(template)
    server = leader["spec"]["containers"][0]
    server["args"] = node_args(server["args"], spec, worker=False)
    server["ports"] = [*server["ports"], {"name": "tp", "containerPort": MASTER_PORT, "protocol": "TCP"}]
    return leader


def _worker(template: dict, spec: PagedLLMSpec) -> dict:
    """The leader's pod without what HTTP needs: no port, no probes, no pre-stop pause."""
    worker = copy.deepcopy(template)
    pod_spec = worker["spec"]
    # NOTE: the worker exits as soon as its leader goes: it needs no drain time of its own
    pod_spec["terminationGracePeriodSeconds"] = 30
    server = pod_spec["containers"][0]
    server["args"] = node_args(server["args"], spec, worker=True)
    for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        server.pop(key, None)
    annotations = worker["metadata"].get("annotations", {})
    for key in [k for k in annotations if k.startswith("prometheus.io/")]:
        del annotations[key]  # NOTE: a worker serves no /metrics
    return worker


def leaders_only(selector: dict[str, str]) -> dict[str, str]:
    return {**selector, **LEADER_ONLY}


def retarget(objects: list[dict], name: str) -> None:
    """Point the fleet objects at the LeaderWorkerSet: autoscalers scale it, the disruption budget covers
    every pod of every group, the other selectors take leaders only."""
    for obj in objects:
        spec = obj.get("spec", {})
        target = spec.get("scaleTargetRef")
        if target is not None:
            spec["scaleTargetRef"] = {**target, "apiVersion": API_VERSION, "kind": KIND, "name": name}
        if obj.get("kind") == "PodDisruptionBudget":
            spec.update(group_disruption_budget())
            continue
        match = (spec.get("selector") or {}).get("matchLabels")
        if match is not None:
            spec["selector"]["matchLabels"] = leaders_only(match)


def group_disruption_budget() -> dict:
    """At most one group disrupted at a time: ``maxUnavailable: 1`` over every pod of every group.

    NOTE: why this does it. An eviction is allowed only while fewer than one selected pod is
    unavailable, i.e. while every group is whole. Evicting any pod (leader or worker) breaks its
    group: ``RecreateGroupOnPodRestart`` recreates all its pods, which stay unavailable until the
    group is ready again, and until then every other eviction is refused. A budget over leaders
    only (what a Service selects) let workers be evicted freely; ``maxUnavailable: size`` would
    let one pod of each of several groups go at once. The pods' controllers are LWS's
    StatefulSets, which the disruption controller counts. ``AlwaysAllow`` lets a drain evict pods
    that are not ready anyway (a group being recreated, a crash loop), so a broken group never
    blocks a drain forever.
    """
    return {"maxUnavailable": 1, "unhealthyPodEvictionPolicy": "AlwaysAllow"}


def spread_over_nodes(manifests: Any, name: str, spec: PagedLLMSpec) -> Any:
    """``manifests`` (a :class:`~pagedllm.operator.manifests.Manifests`) with the Deployment
    replaced by a LeaderWorkerSet and every selector narrowed to the groups' leaders."""
    check_nodes(spec)
    service = copy.deepcopy(manifests.service)
    service["spec"]["selector"] = leaders_only(service["spec"]["selector"])
    if manifests.fleet is not None:
        retarget(manifests.fleet.of_servers(), name)  # NOTE: the picker's selectors name its own pods
    lws = render_leaderworkerset(manifests.deployment, spec)
    return dataclasses.replace(manifests, deployment=lws, service=service)


def missing_workload(outcomes: list[Any]) -> Any:
    """The ``Degraded`` problem of a resource whose LeaderWorkerSet the cluster cannot take; None otherwise."""
    from pagedllm.operator.status import Problem

    for outcome in outcomes:
        if outcome.kind == KIND and not outcome.served:
            return Problem("CRDNotInstalled", outcome.condition()["message"])
    return None


LWS_RESOURCE = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
"""(group, version, plural), for the watch of the operator's LeaderWorkerSets."""


def workload_ref(spec: Mapping[str, Any]) -> tuple[str, str | None]:
    """(kind, apiVersion) of the server pods' owner a raw spec renders to; apiVersion None for the Deployment."""
    nodes = spec.get("nodes")
    if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes > 1:
        return KIND, API_VERSION
    return "Deployment", None
