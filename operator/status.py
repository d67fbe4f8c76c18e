"""A ``PagedLLM``'s status, computed from its Deployment (pure functions).

Phases::

    Pending      no replica ready yet (scheduling, pulling, downloading, loading weights),
                 or scaled to zero
    Progressing  some replicas ready; a rollout or a scale-up is under way
    Ready        every desired replica ready and running the current pod template
    Degraded     the spec cannot be served (Degraded condition says why), or the
                 Deployment reports a failed rollout (ProgressDeadlineExceeded, ReplicaFailure)

Conditions ``Ready``, ``Progressing`` and ``Degraded`` are always all three present;
``lastTransitionTime`` only moves when a condition's status flips. Conditions of other
types (``AutoscalingReady``, ``RoutingReady``, ``MonitoringReady``) are the reconcile's
to set (:mod:`capabilities`) and carried over unchanged here. ``desiredReplicas`` is
spec.replicas, or under autoscaling the autoscaler's current choice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from pagedllm.operator.manifests import GENERATION_ANNOTATION, GROUP, KIND, as_body, endpoint, selector_string

PENDING, PROGRESSING, READY, DEGRADED = "Pending", "Progressing", "Ready", "Degraded"
CONDITION_TYPES = ("Ready", "Progressing", "Degraded")


@dataclass(frozen=True)
class Problem:
    """Why a resource cannot be served right now (a spec error, a refused apply)."""

    reason: str
    message: str


@dataclass(frozen=True)
class _Verdict:
    phase: str
    reason: str
    message: str


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _deployment_failure(deployment: Mapping[str, Any]) -> Problem | None:
    for cond in deployment.get("status", {}).get("conditions", []) or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return Problem("ProgressDeadlineExceeded", cond.get("message") or "the rollout made no progress in time")
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return Problem(cond.get("reason") or "ReplicaFailure", cond.get("message") or "pods could not be created")
    return None


def _rolled_out(deployment: Mapping[str, Any]) -> bool:
    generation = deployment.get("metadata", {}).get("generation")
    observed = deployment.get("status", {}).get("observedGeneration")
    return generation is None or (observed is not None and observed >= generation)


def _verdict(
    deployment: Mapping[str, Any] | None, desired: int, problem: Problem | None, autoscaled: bool = False
) -> _Verdict:
    if problem is not None:
        return _Verdict(DEGRADED, problem.reason, problem.message)
    if deployment is None:
        return _Verdict(PENDING, "DeploymentMissing", "the Deployment does not exist yet")
    failure = _deployment_failure(deployment)
    if failure is not None:
        return _Verdict(DEGRADED, failure.reason, failure.message)
    status = deployment.get("status", {}) or {}
    ready, updated, current = (_int(status.get(k), 0) for k in ("readyReplicas", "updatedReplicas", "replicas"))
    if desired == 0 and autoscaled:
        return _Verdict(
            PENDING, "ScaledToZero", "the autoscaler scaled to zero: requests fail until it starts a replica"
        )
    if desired == 0:
        return _Verdict(PENDING, "ScaledToZero", "spec.replicas is 0: scale up to serve")
    if _rolled_out(deployment) and ready >= desired and updated >= desired and current == desired:
        return _Verdict(READY, "AllReplicasReady", f"{ready}/{desired} replicas ready")
    if ready == 0:
        return _Verdict(
            PENDING, "WaitingForReplicas", f"0/{desired} replicas ready: scheduling, downloading or loading the model"
        )
    return _Verdict(PROGRESSING, "RollingOut", f"{ready}/{desired} replicas ready, {updated} up to date")


def _conditions(verdict: _Verdict, previous: list, generation: int | None, now: str) -> list[dict]:
    wanted = {
        "Ready": verdict.phase == READY,
        "Progressing": verdict.phase in (PENDING, PROGRESSING) and verdict.reason != "ScaledToZero",
        "Degraded": verdict.phase == DEGRADED,
    }
    before = {c.get("type"): c for c in previous or [] if isinstance(c, Mapping)}
    # NOTE: the other conditions (RoutingReady, ...) are the apply's to set; they are kept as they are.
    out = [dict(c) for kind, c in before.items() if kind not in CONDITION_TYPES]
    for kind in CONDITION_TYPES:
        status = "True" if wanted[kind] else "False"
        old = before.get(kind, {})
        cond = {
            "type": kind,
            "status": status,
            "reason": verdict.reason,
            "message": verdict.message,
            "lastTransitionTime": old.get("lastTransitionTime", now) if old.get("status") == status else now,
        }
        if generation is not None:
            cond["observedGeneration"] = generation
        out.append(cond)
    return sorted(out, key=_condition_order)


def _condition_order(cond: Mapping[str, Any]) -> tuple[int, str]:
    kind = str(cond.get("type"))
    return (CONDITION_TYPES.index(kind) if kind in CONDITION_TYPES else len(CONDITION_TYPES), kind)


SERVER_EXITED = "ServerExited"


def server_exit(pod: Mapping[str, Any], container: str) -> Problem | None:
    """Why the pod's server container last exited with an error, if it did and the pod is not ready.

    The server writes a start-up refusal (say, a tensor-parallel size the model's heads
    cannot be split into) to its termination log, which Kubernetes keeps in the
    container's state; that is what the operator can tell the user the spec cannot do.
    """
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Ready" and cond.get("status") == "True":
            return None
    for state in status.get("containerStatuses") or []:
        if state.get("name") != container:
            continue
        for kind in ("state", "lastState"):
            terminated = (state.get(kind) or {}).get("terminated") or {}
            code = terminated.get("exitCode")
            if isinstance(code, int) and code != 0:
                why = (terminated.get("message") or terminated.get("reason") or "").strip()
                pod_name = (pod.get("metadata") or {}).get("name", "")
                return Problem(SERVER_EXITED, f"pod {pod_name}: the server exited with code {code}: {why}"[:1000])
    return None


def standing_problem(body: Mapping[str, Any], reasons: tuple[str, ...]) -> Problem | None:
    """The ``Degraded`` problem of one of ``reasons`` that ``body``'s status reports for its current generation."""
    generation = body.get("metadata", {}).get("generation")
    for cond in (body.get("status") or {}).get("conditions", []) or []:
        if (
            cond.get("type") == DEGRADED
            and cond.get("status") == "True"
            and cond.get("reason") in reasons
            and cond.get("observedGeneration") == generation
        ):
            return Problem(cond["reason"], cond.get("message", ""))
    return None


def status_from(
    body: Mapping[str, Any], deployment: Mapping[str, Any] | None, *, now: str, problem: Problem | None = None
) -> dict:
    """The ``status`` of the resource ``body`` given its Deployment (``None`` if absent).

    ``problem`` overrides everything with ``Degraded`` (a spec the operator refused).
    ``now`` is an RFC 3339 timestamp, passed in to keep this a pure function.
    """
    meta = body.get("metadata", {})
    spec = body.get("spec") or {}
    name, namespace = meta.get("name", ""), meta.get("namespace", "")
    autoscaling = spec.get("autoscaling")
    desired = desired_replicas(spec, deployment)
    dep_status = (deployment or {}).get("status", {}) or {}
    ready = _int(dep_status.get("readyReplicas"), 0)
    verdict = _verdict(deployment, desired, problem, autoscaled=isinstance(autoscaling, Mapping))
    generation = _observed_generation(meta, deployment, problem)
    status = {
        "phase": verdict.phase,
        "desiredReplicas": desired,
        "replicas": _int(dep_status.get("replicas"), 0),
        "readyReplicas": ready,
        "ready": f"{ready}/{desired}",
        "selector": selector_string(name),
        "endpoint": endpoint(name, namespace, _int(spec.get("port"), 8000)),
        "conditions": _conditions(verdict, (body.get("status") or {}).get("conditions", []), generation, now),
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def desired_replicas(spec: Mapping[str, Any], deployment: Mapping[str, Any] | None) -> int:
    """spec.replicas (1 if unset), or under autoscaling the count the autoscaler last set."""
    autoscaling = spec.get("autoscaling")
    if not isinstance(autoscaling, Mapping):
        return _int(spec.get("replicas"), 1)
    scaled = ((deployment or {}).get("spec") or {}).get("replicas")
    return _int(scaled, _int(autoscaling.get("minReplicas"), 1))


def _observed_generation(
    meta: Mapping[str, Any], deployment: Mapping[str, Any] | None, problem: Problem | None
) -> int | None:
    """The generation this status speaks for: the one refused, or the one the Deployment runs."""
    if problem is None and deployment is not None:
        applied = deployment.get("metadata", {}).get("annotations", {}).get(GENERATION_ANNOTATION)
        if applied is not None and str(applied).isdigit():
            return int(applied)
    generation = meta.get("generation")
    return generation if isinstance(generation, int) else None


def owner_name(body: Mapping[str, Any]) -> str | None:
    """The ``PagedLLM`` that controls this object, if any."""
    for ref in body.get("metadata", {}).get("ownerReferences", []) or []:
        if ref.get("kind") == KIND and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/"):
            return ref.get("name")
    return None


def comparable(current: Mapping[str, Any] | None, wanted: Mapping[str, Any]) -> dict:
    """The current status restricted to the keys we write, to skip no-op patches."""
    current = current or {}
    return {key: current.get(key) for key in wanted}


def announce_phase(owner: Mapping[str, Any], status: Mapping[str, Any]) -> None:
    """A Kubernetes Event on the resource when its phase changes (``kubectl describe pllm`` shows them)."""
    old, new = (owner.get("status") or {}).get("phase"), status.get("phase")
    if new is None or old == new:
        return
    reason = next((c.get("message") for c in status.get("conditions", []) if c.get("status") == "True"), "")
    message = f"{old or 'new'} -> {new}" + (f": {reason}" if reason else "")
    if new == DEGRADED:
        kopf.warn(as_body(owner), reason="PhaseChanged", message=message)
    else:
        kopf.info(as_body(owner), reason="PhaseChanged", message=message)
