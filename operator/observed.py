"""What the cluster holds for one ``PagedLLM`` right now, and the problem it shows.

:func:`observe` reads it (the children the rendering names, the server pods while not
every replica is ready); :func:`problem_of` is pure: which ``Degraded`` problem, if any,
the reconcile reports, given the spec, this pass's apply and what was observed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedllm.operator.apply import REFUSALS
from pagedllm.operator.kube import collection_path
from pagedllm.operator.leaderworkerset import workload_ref
from pagedllm.operator.manifests import INSTANCE_LABEL, MANAGED_BY, SERVER_CONTAINER
from pagedllm.operator.status import Problem, desired_replicas, server_exit, standing_problem

INVALID_SPEC = "InvalidSpec"


class Reader(Protocol):
    async def get(self, kind: str, namespace: str, name: str, api_version: str | None = None) -> dict | None: ...

    async def request(self, method: str, path: str, *, query: list | None = None) -> Any: ...


@dataclass(frozen=True)
class Observed:
    """Live objects of one resource: its children by (kind, name), and its server pods."""

    children: Mapping[tuple[str, str], dict] = field(default_factory=dict)
    """(kind, name) -> the object as the API server holds it; a missing child is absent."""
    pods: tuple[dict, ...] = ()
    """The server pods; only listed while some desired replica is not ready."""
    picker_slices: tuple[dict, ...] = ()
    """EndpointSlices of the endpoint picker's Service; only listed with an InferencePool."""

    def get(self, kind: str, name: str) -> dict | None:
        return self.children.get((kind, name))

    def workload(self, owner: Mapping[str, Any]) -> dict | None:
        """The server pods' owner the spec renders to: the Deployment or the LeaderWorkerSet."""
        return self.get(workload_ref(owner.get("spec") or {})[0], owner["metadata"]["name"])

    def with_applied(self, applied: Iterable[Mapping[str, Any]]) -> Observed:
        """This view with the objects an apply just answered (fresher than what was read before)."""
        children = dict(self.children)
        for obj in applied:
            children[(obj["kind"], obj["metadata"]["name"])] = dict(obj)
        return Observed(children, self.pods, self.picker_slices)


def instance_selector(name: str) -> str:
    return f"{INSTANCE_LABEL}={name},app.kubernetes.io/managed-by={MANAGED_BY}"


async def observe(kube: Reader, owner: Mapping[str, Any], manifests: Iterable[Mapping[str, Any]]) -> Observed:
    """Read the children ``manifests`` name (the workload always), and the pods if not all are ready.

    Raises :class:`~pagedllm.operator.kube.ApiError` as the client does.
    """
    meta = owner["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    wanted = {(m["kind"], m["metadata"]["name"]): m["apiVersion"] for m in manifests}
    workload_kind, workload_api = workload_ref(owner.get("spec") or {})
    wanted.setdefault((workload_kind, name), workload_api or "apps/v1")
    children: dict[tuple[str, str], dict] = {}
    for (kind, child), api_version in wanted.items():
        live = await kube.get(kind, namespace, child, api_version=api_version)
        if live is not None:
            children[(kind, child)] = live
    pool = next((m for m in manifests if m["kind"] == "InferencePool"), None)
    picker = ((pool or {}).get("spec", {}).get("endpointPickerRef") or {}).get("name")
    slices = await _list(kube, "EndpointSlice", namespace, f"{SERVICE_NAME_LABEL}={picker}") if picker else ()
    deployment = children.get((workload_kind, name))
    ready = int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
    if deployment is None or ready >= desired_replicas(owner.get("spec") or {}, deployment):
        return Observed(children, (), slices)
    return Observed(children, await _list(kube, "Pod", namespace, instance_selector(name)), slices)


async def list_pods(kube: Reader, owner: Mapping[str, Any]) -> tuple[dict, ...]:
    """The server pods of ``owner`` (a LeaderWorkerSet's workers too)."""
    meta = owner["metadata"]
    return await _list(kube, "Pod", meta["namespace"], instance_selector(meta["name"]))


# The label the EndpointSlice controller puts on every slice of a Service.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


async def _list(kube: Reader, kind: str, namespace: str, selector: str) -> tuple[dict, ...]:
    found = await kube.request("GET", collection_path(kind, namespace), query=[("labelSelector", selector)])
    return tuple((found or {}).get("items", []))


def problem_of(
    owner: Mapping[str, Any],
    observed: Observed,
    *,
    spec_error: str | None = None,
    refused: Problem | None = None,
    applied: bool = False,
) -> Problem | None:
    """The ``Degraded`` problem to report, the first that holds of:

    the spec cannot be rendered; this pass's apply was refused; an apply refused earlier for
    this generation and not tried again (``applied`` false); a server pod exited with an error
    while some desired replica is not ready.
    """
    if spec_error is not None:
        return Problem(INVALID_SPEC, spec_error)
    if refused is not None:
        return refused
    if not applied:
        standing = standing_problem(owner, REFUSALS)
        if standing is not None:
            return standing
    exits = (server_exit(pod, SERVER_CONTAINER) for pod in observed.pods)
    return next((problem for problem in exits if problem is not None), None)
