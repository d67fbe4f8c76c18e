"""Whether the fleet objects work, read from their own status (pure functions).

Applying an object says nothing about whether it does its job, so the feature conditions
come from what the controllers that act on them report::

    AutoscalingReady   HorizontalPodAutoscaler   AbleToScale and ScalingActive True (it reads its metric)
                       ScaledObject (KEDA)       Ready True
    RoutingReady       InferencePool             a Gateway accepted it (status.parents[].conditions
                                                 Accepted True, none with ResolvedRefs False), and
                                                 the endpoint picker Service has a ready endpoint
    MonitoringReady    PodMonitor                applied (the Prometheus Operator reports no status)

Each judge returns (status, reason, message) for the condition.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

NOT_REPORTED = "NotReported"
Verdict = tuple[str, str, str]


def _conditions(obj: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    found = ((obj or {}).get("status") or {}).get("conditions") or []
    return {str(c.get("type")): c for c in found if isinstance(c, Mapping)}


def hpa_verdict(hpa: Mapping[str, Any]) -> Verdict:
    """``AutoscalingReady`` from a HorizontalPodAutoscaler's ``AbleToScale`` and ``ScalingActive``."""
    name = hpa.get("metadata", {}).get("name", "")
    conds = _conditions(hpa)
    if not conds:
        return "False", NOT_REPORTED, f"HorizontalPodAutoscaler {name} has not reported its state yet"
    for kind in ("AbleToScale", "ScalingActive"):
        cond = conds.get(kind)
        if cond is None or cond.get("status") != "True":
            reason = (cond or {}).get("reason") or f"No{kind}"
            said = (cond or {}).get("message") or "no condition reported"
            message = f"HorizontalPodAutoscaler {name}: {kind} is not True ({reason}: {said})"
            if kind == "ScalingActive":
                message += "; the custom metrics API must serve the pagedllm:* metrics (chart: prometheusAdapter)"
            return "False", reason, message
    active = conds["ScalingActive"]
    return (
        "True",
        active.get("reason") or "ScalingActive",
        f"HorizontalPodAutoscaler {name}: {active.get('message', '')}",
    )


def scaled_object_verdict(scaled: Mapping[str, Any]) -> Verdict:
    """``AutoscalingReady`` from a KEDA ScaledObject's ``Ready`` condition."""
    name = scaled.get("metadata", {}).get("name", "")
    ready = _conditions(scaled).get("Ready")
    if ready is None or ready.get("status") == "Unknown":
        return "False", NOT_REPORTED, f"ScaledObject {name}: KEDA has not reported it Ready yet"
    reason = ready.get("reason") or ("ScaledObjectReady" if ready.get("status") == "True" else "NotReady")
    return ready.get("status", "False"), reason, f"ScaledObject {name}: {ready.get('message') or reason}"


def ready_endpoints(slices: Iterable[Mapping[str, Any]]) -> int:
    """Endpoints of ``slices`` (EndpointSlices) that are ready (an unset ``ready`` counts as ready)."""
    return sum(
        1
        for piece in slices
        for endpoint in piece.get("endpoints") or []
        if (endpoint.get("conditions") or {}).get("ready") is not False
    )


def pool_verdict(pool: Mapping[str, Any], picker_slices: Iterable[Mapping[str, Any]]) -> Verdict:
    """``RoutingReady`` from an InferencePool's parents and its endpoint picker's endpoints."""
    name = pool.get("metadata", {}).get("name", "")
    picker = ((pool.get("spec") or {}).get("endpointPickerRef") or {}).get("name", "")
    parents = ((pool.get("status") or {}).get("parents")) or []
    for parent in parents:
        refs = _conditions({"status": parent}).get("ResolvedRefs")
        if refs is not None and refs.get("status") == "False":
            gateway = (parent.get("parentRef") or {}).get("name", "?")
            said = refs.get("message") or refs.get("reason") or ""
            return (
                "False",
                refs.get("reason") or "ResolvedRefs",
                f"Gateway {gateway} cannot resolve InferencePool {name}: {said}",
            )
    accepted = [p for p in parents if (_conditions({"status": p}).get("Accepted") or {}).get("status") == "True"]
    if not accepted:
        return (
            "False",
            "NotAccepted",
            (
                f"no Gateway has accepted InferencePool {name} (status.parents): route to it from an HTTPRoute "
                "of a Gateway that implements the Inference Extension"
            ),
        )
    if ready_endpoints(picker_slices) == 0:
        return (
            "False",
            "EndpointPickerUnavailable",
            (
                f"the endpoint picker Service {picker} has no ready endpoint: the Gateway cannot route to "
                f"InferencePool {name} (deploy it: spec.routing.endpointPicker.deploy)"
            ),
        )
    gateways = ", ".join(sorted((p.get("parentRef") or {}).get("name", "?") for p in accepted))
    return "True", "Accepted", f"InferencePool {name} accepted by {gateways}; endpoint picker {picker} ready"
