"""Which of a resource's objects this cluster can take, and the conditions that say so.

A KEDA ``ScaledObject``, an ``InferencePool`` and a ``PodMonitor`` exist only where their
CRDs are installed. Rendering makes them regardless (it is pure); before applying, the
handlers ask API discovery whether the kind is served, apply what is, and report each
feature as a condition on the resource::

    AutoscalingReady   HorizontalPodAutoscaler / ScaledObject    what it reports | False CRDNotInstalled
    RoutingReady       InferencePool                             what it reports | False CRDNotInstalled
    MonitoringReady    PodMonitor                                True Applied    | False CRDNotInstalled
    MultiNodeReady     LeaderWorkerSet (spec.nodes > 1)          True Applied    | False CRDNotInstalled,
                                                                 and the resource is Degraded

What an applied object reports is judged in :mod:`readiness`. A feature the spec does not
ask for has no condition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

APPLIED, NOT_INSTALLED = "Applied", "CRDNotInstalled"


@dataclass(frozen=True)
class Feature:
    """What a kind is for: its condition type, its CRD, and what happens without it."""

    condition: str
    crd: str | None
    provider: str
    without: str


FEATURES: Mapping[str, Feature] = {
    "HorizontalPodAutoscaler": Feature("AutoscalingReady", None, "Kubernetes", ""),
    "ScaledObject": Feature("AutoscalingReady", "scaledobjects.keda.sh", "KEDA", "the replicas stay as they are"),
    "HTTPScaledObject": Feature(
        "AutoscalingReady",
        "httpscaledobjects.http.keda.sh",
        "KEDA's HTTP add-on",
        "the replicas stay as they are, and NAME-http reaches no interceptor",
    ),
    "InferencePool": Feature(
        "RoutingReady",
        "inferencepools.inference.networking.k8s.io",
        "the Gateway API Inference Extension",
        "clients reach the pods through the Service only",
    ),
    "PodMonitor": Feature(
        "MonitoringReady",
        "podmonitors.monitoring.coreos.com",
        "the Prometheus Operator",
        "the pods' prometheus.io/scrape annotations remain for annotation-driven scraping",
    ),
    "LeaderWorkerSet": Feature(
        "MultiNodeReady",
        "leaderworkersets.leaderworkerset.x-k8s.io",
        "LeaderWorkerSet (kubernetes-sigs/lws)",
        "nothing runs: a replica of spec.nodes > 1 pods needs it",
    ),
}
CONDITION_TYPES = frozenset(f.condition for f in FEATURES.values())


class Discovery(Protocol):
    async def served(self, api_version: str, kind: str) -> bool: ...


@dataclass(frozen=True)
class Outcome:
    """One feature object's fate: applied, or skipped because its kind is not served."""

    kind: str
    name: str
    api_version: str
    served: bool

    def condition(self, verdict: tuple[str, str, str] | None = None) -> dict[str, Any]:
        """The feature's condition; ``verdict`` (status, reason, message) is what the live object says."""
        feature = FEATURES[self.kind]
        if self.served and verdict is not None:
            status, reason, message = verdict
            return {"type": feature.condition, "status": status, "reason": reason, "message": message}
        if self.served:
            message = f"{self.kind} {self.name} applied"
            return {"type": feature.condition, "status": "True", "reason": APPLIED, "message": message}
        message = (
            f"{self.kind} {self.name} was not created: the cluster does not serve {self.api_version} {self.kind} "
            f"(CRD {feature.crd}; install {feature.provider}); {feature.without}"
        )
        return {"type": feature.condition, "status": "False", "reason": NOT_INSTALLED, "message": message}


async def servable(manifests: Iterable[Mapping[str, Any]], kube: Discovery) -> tuple[list[dict], list[Outcome]]:
    """The manifests the cluster can take (in order), and the outcome of each feature object."""
    keep: list[dict] = []
    outcomes: list[Outcome] = []
    for manifest in manifests:
        kind = manifest["kind"]
        feature = FEATURES.get(kind)
        served = feature is None or feature.crd is None or await kube.served(manifest["apiVersion"], kind)
        if served:
            keep.append(dict(manifest))
        if feature is not None:
            outcomes.append(Outcome(kind, manifest["metadata"]["name"], manifest["apiVersion"], served))
    return keep, outcomes


def with_features(
    status: Mapping[str, Any],
    outcomes: Iterable[Outcome],
    now: str,
    judge: Callable[[Outcome], tuple[str, str, str] | None] = lambda outcome: None,
) -> dict:
    """``status`` with the feature conditions of ``outcomes`` (others of those types removed).

    ``judge`` gives what a served object's live state says (:mod:`readiness`), ``None`` where
    there is nothing to read. ``lastTransitionTime`` stays while a condition's status does not change.
    """
    conditions = list(status.get("conditions") or [])
    before = {c.get("type"): c for c in conditions}
    kept = [c for c in conditions if c.get("type") not in CONDITION_TYPES]
    for outcome in outcomes:
        cond = outcome.condition(judge(outcome))
        old = before.get(cond["type"], {})
        cond["lastTransitionTime"] = old.get("lastTransitionTime", now) if old.get("status") == cond["status"] else now
        generation = status.get("observedGeneration")
        if isinstance(generation, int):
            cond["observedGeneration"] = generation
        kept.append(cond)
    return {**status, "conditions": kept}
