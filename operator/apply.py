"""Applying a rendering: each child on its own, so one refusal never blocks the others.

A claim whose immutable fields changed (the API answers 422), a kind the operator may
not write (403) or a same-named object that another controller owns is reported and
skipped; the Deployment and Service are still applied. What went wrong comes back as
data (:class:`ApplyOutcome`), for the handlers to turn into a condition or a retry.

A Deployment that an autoscaler takes over keeps its replica count: see
:func:`replicas_to_hand_over`.

A fleet object the rendering no longer asks for (autoscaling, routing turned off, one
replica left) is deleted when it is the owner's: a HorizontalPodAutoscaler left behind
would keep resizing a Deployment whose replicas the operator sets again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedllm.operator.drift import foreign_controller
from pagedllm.operator.kube import FIELD_MANAGER, ApiError
from pagedllm.operator.status import Problem

# The objects a rendering may stop asking for, by the resource's name. The claim is never
# pruned (it holds downloaded weights); the Deployment and Service are always rendered.
PRUNABLE: tuple[tuple[str, str], ...] = (
    ("policy/v1", "PodDisruptionBudget"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("http.keda.sh/v1alpha1", "HTTPScaledObject"),
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    # NOTE: the server pods' owner switches kind with spec.nodes (see leaderworkerset.py)
    ("apps/v1", "Deployment"),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)
# Objects named NAME + suffix that a rendering may stop asking for: (apiVersion, kind, suffix).
PRUNABLE_SUFFIXED: tuple[tuple[str, str, str], ...] = (
    ("networking.k8s.io/v1", "NetworkPolicy", "-model-download"),
    ("v1", "ConfigMap", "-adapters"),
    ("v1", "Service", "-http"),  # the HTTP add-on's address of a model that no longer scales from zero
)
WORKLOAD_KINDS = ("Deployment", "LeaderWorkerSet")

# Keeps a Deployment's replica count while the operator stops applying it (autoscaling turned on).
HANDOVER_MANAGER = "pagedllm-operator-handover"

APPLY_REFUSED = "ApplyRefused"
ADOPTION_REFUSED = "AdoptionRefused"
REFUSALS = (APPLY_REFUSED, ADOPTION_REFUSED)


class Kube(Protocol):
    async def get(self, kind: str, namespace: str, name: str, api_version: str | None = None) -> dict | None: ...

    async def apply(self, manifest: Mapping[str, Any], field_manager: str = FIELD_MANAGER) -> dict: ...

    async def delete(self, kind: str, namespace: str, name: str, api_version: str, uid: str) -> None: ...


@dataclass
class ApplyOutcome:
    """What one pass over the rendering did."""

    applied: dict[str, dict] = field(default_factory=dict)
    """``Kind name`` -> the object as the API server answered the apply."""
    refused: list[Problem] = field(default_factory=list)
    """Children the operator cannot apply until something changes (spec, RBAC, the other owner)."""
    transient: list[str] = field(default_factory=list)
    """Children whose apply failed for a reason that may pass (conflict, throttling, 5xx)."""
    deleted: list[str] = field(default_factory=list)
    """Kinds of owned objects deleted because the rendering no longer has them."""

    def problem(self) -> Problem | None:
        """All refusals as one ``Degraded`` reason and message; ``None`` if there were none."""
        if not self.refused:
            return None
        message = "; ".join(p.message for p in self.refused)
        if self.transient:
            message += "; retrying: " + "; ".join(self.transient)
        return Problem(self.refused[0].reason, message)


async def apply_all(manifests: Iterable[Mapping[str, Any]], kube: Kube, owner_uid: str | None) -> ApplyOutcome:
    """Apply each manifest, whatever the others did; the Deployment last.

    NOTE: its pods then start only once what they use (the claim, the Service) exists, and
    the status the caller reads right after is as fresh as it can be.
    """
    outcome = ApplyOutcome()
    for manifest in sorted(manifests, key=lambda m: m["kind"] in WORKLOAD_KINDS):
        kind, meta = manifest["kind"], manifest["metadata"]
        what = f"{kind} {meta['name']}"
        try:
            live = await kube.get(kind, meta["namespace"], meta["name"], api_version=manifest["apiVersion"])
            other = foreign_controller(live, owner_uid)
            if other is not None:
                outcome.refused.append(
                    Problem(ADOPTION_REFUSED, f"{what} already exists and is controlled by {other}: not taking it over")
                )
                continue
            replicas = replicas_to_hand_over(manifest, live)
            if replicas is not None:
                await kube.apply(_replicas_only(manifest, replicas), field_manager=HANDOVER_MANAGER)
            outcome.applied[what] = await kube.apply(manifest)
        except ApiError as exc:
            if exc.retriable:
                outcome.transient.append(f"{what}: {exc}")
            else:
                outcome.refused.append(Problem(APPLY_REFUSED, f"{what}: {exc.message}"))
    return outcome


def replicas_to_hand_over(manifest: Mapping[str, Any], live: Mapping[str, Any] | None) -> int | None:
    """The live replica count to hand over before applying a workload that no longer sets it.

    NOTE: server-side apply removes a field that its only manager stops applying, and a
    Deployment or LeaderWorkerSet without replicas defaults to 1: turning autoscaling on for a fleet of 4
    would drop it to 1 pod until the new autoscaler acts. Applying the current count
    first under a second field manager keeps it (the Kubernetes documentation's
    "transferring ownership" to a HorizontalPodAutoscaler); the autoscaler then owns it.
    """
    if manifest["kind"] not in WORKLOAD_KINDS or "replicas" in manifest["spec"] or live is None:
        return None
    replicas = (live.get("spec") or {}).get("replicas")
    if not isinstance(replicas, int) or isinstance(replicas, bool):
        return None
    for entry in live.get("metadata", {}).get("managedFields") or []:
        owned = ((entry.get("fieldsV1") or {}).get("f:spec") or {}).keys()
        if entry.get("manager") == FIELD_MANAGER and entry.get("operation") == "Apply" and "f:replicas" in owned:
            return replicas
    return None


def _replicas_only(manifest: Mapping[str, Any], replicas: int) -> dict:
    meta = manifest["metadata"]
    return {
        "apiVersion": manifest["apiVersion"],
        "kind": manifest["kind"],
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "spec": {"replicas": replicas},
    }


async def prune(rendered: list[dict], kube: Kube, owner_uid: str | None, outcome: ApplyOutcome) -> None:
    """Delete the owner's fleet objects of kinds not in ``rendered``, into ``outcome``.

    Another controller's objects of those names are left alone.
    """
    kept = {(m["kind"], m["metadata"]["name"]) for m in rendered}
    meta = next(m["metadata"] for m in rendered if m["kind"] in WORKLOAD_KINDS)
    namespace, name = meta["namespace"], meta["name"]
    candidates = [(api, kind, name) for api, kind in PRUNABLE]
    candidates += [(api, kind, name + suffix) for api, kind, suffix in PRUNABLE_SUFFIXED]
    for api_version, kind, child in candidates:
        if (kind, child) in kept or owner_uid is None:
            continue
        what = f"{kind} {child}"
        try:
            live = await kube.get(kind, namespace, child, api_version=api_version)  # None: not served or absent
            if live is None or not _controlled_by(live, owner_uid):
                continue
            await kube.delete(kind, namespace, child, api_version, live["metadata"]["uid"])
            outcome.deleted.append(kind)
        except ApiError as exc:
            if exc.status in (404, 409):  # gone already, or replaced by a namesake since the get
                continue
            if exc.retriable:
                outcome.transient.append(f"deleting {what}: {exc}")
            else:
                outcome.refused.append(Problem(APPLY_REFUSED, f"deleting {what}: {exc.message}"))


def _controlled_by(live: Mapping[str, Any], owner_uid: str) -> bool:
    refs = live.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("controller") and ref.get("uid") == owner_uid for ref in refs)
