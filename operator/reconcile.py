"""The one reconcile of a ``PagedLLM``: read, apply what is needed, write the status.

Every handler ends here (controller-runtime's shape: one reconcile per owner kind, child
events enqueue the owner)::

    spec created / changed / operator resumed   -> Trigger(apply=True)        apply everything
    child or pod event                           -> Trigger()                  apply a missing or drifted child
    periodic check                               -> Trigger(retry_refused=True) also retry a refused apply

A pass reads the owner afresh (never the event's copy), renders it, reads its children,
applies when the trigger or what it found asks for it, and writes the status computed
from what it read and applied. It runs under :class:`~pagedllm.operator.owner_gate.OwnerGate`,
so it is the only writer of its owner's status at any moment; running it again with
nothing changed writes nothing.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from pagedllm.operator.adapter_sync import AdapterReport, sync_adapters, with_adapters
from pagedllm.operator.apply import APPLY_REFUSED, REFUSALS, apply_all, prune
from pagedllm.operator.backoff import Backoff, RepairPacer
from pagedllm.operator.capabilities import Outcome, servable, with_features
from pagedllm.operator.drift import drifted
from pagedllm.operator.kube import ApiError, KubeClient
from pagedllm.operator.leaderworkerset import KIND as LWS_KIND
from pagedllm.operator.leaderworkerset import missing_workload
from pagedllm.operator.manifests import GENERATION_ANNOTATION, KIND, RenderConfig, as_body, render
from pagedllm.operator.observed import INVALID_SPEC, Observed, list_pods, observe, problem_of
from pagedllm.operator.policy import AdminPolicy
from pagedllm.operator.readiness import Verdict, hpa_verdict, pool_verdict, scaled_object_verdict
from pagedllm.operator.spec import PagedLLMSpec, SpecError
from pagedllm.operator.status import (
    DEGRADED,
    Problem,
    announce_phase,
    comparable,
    owner_name,
    standing_problem,
    status_from,
)

# kopf retries a failed reconcile after RETRY.delay(retry): 10 s, 20 s, 40 s … 5 min.
RETRY = Backoff(base=10, cap=300)
# Children whose hand edits are reverted (the fleet objects are only recreated when missing).
DRIFT_CHECKED = ("Deployment", LWS_KIND, "Service", "NetworkPolicy")
WORKLOADS = ("Deployment", LWS_KIND)

__all__ = ["INVALID_SPEC", "RETRY", "Trigger", "now", "reconcile"]


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Trigger:
    """Why a reconcile runs, which decides whether it applies."""

    apply: bool = False
    """The spec changed or the operator resumed: apply the whole rendering."""
    retry_refused: bool = False
    """Apply again even though the API refused this generation before (the periodic check)."""
    announce: bool = False
    """Record an ``Applied`` event (not on resume: nothing changed for the user)."""
    retry: int = 0
    """Failed attempts before this one (kopf's count); sets the retry delay."""


async def reconcile(
    namespace: str,
    name: str,
    kube: KubeClient,
    config: RenderConfig,
    pacer: RepairPacer,
    logger: logging.Logger | logging.LoggerAdapter,
    trigger: Trigger,
    policy: AdminPolicy = AdminPolicy(),
) -> dict | None:
    """One pass for the ``PagedLLM`` ``namespace/name``; the status it holds afterwards (``None``: gone).

    ``policy`` is the admin's allow-lists. Raises only ``kopf.TemporaryError`` (transient API
    trouble), with :data:`RETRY`'s delay, or ``kopf.PermanentError`` (the API refused a read).
    """
    try:
        return await _reconcile(namespace, name, kube, config, pacer, logger, trigger, policy)
    except ApiError as exc:
        if not exc.retriable:
            raise kopf.PermanentError(f"{KIND} {namespace}/{name}: {exc}") from exc
        raise kopf.TemporaryError(f"{KIND} {namespace}/{name}: {exc}", delay=RETRY.delay(trigger.retry)) from exc


async def _reconcile(
    namespace: str,
    name: str,
    kube: KubeClient,
    config: RenderConfig,
    pacer: RepairPacer,
    logger: logging.Logger | logging.LoggerAdapter,
    trigger: Trigger,
    policy: AdminPolicy,
) -> dict | None:
    owner = await kube.get(KIND, namespace, name)
    if owner is None or owner.get("metadata", {}).get("deletionTimestamp"):
        return None  # being deleted: its children go with it
    try:
        manifests = render(owner, config).all()
    except SpecError as exc:
        observed = await observe(kube, owner, [])
        return await _write(owner, observed, kube, problem_of(owner, observed, spec_error=str(exc)), None)
    spec = PagedLLMSpec.from_dict(owner.get("spec"))
    refusal = policy.check(spec, config.default_image, config.endpoint_picker_image)
    if refusal is not None:  # NOTE: like a spec error: nothing is applied, what runs keeps running
        return await _write(owner, await observe(kube, owner, []), kube, refusal, None)
    try:
        # Kinds of CRDs the cluster lacks are skipped, and said so in a condition.
        wanted, features = await servable(manifests, kube)
    except ApiError as exc:
        if exc.retriable:
            raise
        problem = Problem(APPLY_REFUSED, f"API discovery for {name}: {exc.message}")
        return await _write(owner, await observe(kube, owner, []), kube, problem, None)
    try:
        observed = await observe(kube, owner, wanted)
    except ApiError as exc:
        if exc.retriable:
            raise
        problem = Problem(APPLY_REFUSED, f"reading the children of {name}: {exc.message}")
        return await _write(owner, Observed(), kube, problem, None)
    reasons = apply_reasons(owner, wanted, observed, trigger, pacer)
    refused: Problem | None = None
    if reasons:
        _announce_repairs(owner, reasons, trigger)
        refused, observed = await _apply(owner, manifests, wanted, observed, kube, trigger, logger)
    adapters = await _sync_adapters(owner, spec, kube, observed) if spec.lora_enabled else None
    reported = problem_of(owner, observed, refused=refused, applied=bool(reasons))
    return await _write(owner, observed, kube, reported, features, (spec, adapters))


@dataclass(frozen=True)
class Reason:
    """Why a pass applies: ``kind`` ``child`` missing, drifted at ``paths``, or the spec asks."""

    kind: str
    child: str
    paths: tuple[str, ...] = ()
    missing: bool = False


def apply_reasons(
    owner: Mapping[str, Any], wanted: list[dict], observed: Observed, trigger: Trigger, pacer: RepairPacer
) -> list[Reason]:
    """What makes this pass apply; empty when nothing does.

    NOTE: a refusal of the API for this generation is not retried on every event (a 403
    would otherwise be asked again for each status change of a sibling): only a spec
    change or the periodic check tries again.
    """
    if trigger.apply:
        return [Reason(KIND, owner["metadata"]["name"])]
    if standing_problem(owner, REFUSALS) is not None and not trigger.retry_refused:
        return []
    reasons = []
    for manifest in wanted:
        kind, child = manifest["kind"], manifest["metadata"]["name"]
        live = observed.get(kind, child)
        if live is None or owner_name(live) != owner["metadata"]["name"]:
            reasons.append(Reason(kind, child, missing=True))
        elif kind in DRIFT_CHECKED:
            reasons += _drift(owner, manifest, live, pacer)
    return reasons


def _drift(owner: Mapping[str, Any], manifest: Mapping[str, Any], live: Mapping[str, Any], pacer: RepairPacer) -> list:
    kind, child = manifest["kind"], manifest["metadata"]["name"]
    key = (kind, owner["metadata"]["namespace"], child)
    applied = (live.get("metadata", {}).get("annotations") or {}).get(GENERATION_ANNOTATION)
    paths = drifted(manifest, live)
    if kind in WORKLOADS and applied is not None and applied != str(owner["metadata"].get("generation")):
        return [Reason(kind, child)]  # a spec change not applied yet: not a hand edit
    if not paths:
        pacer.settled(key)
        return []
    if not pacer.due(key):
        return []  # NOTE: drifting again right after a repair: wait (backoff) before the next
    pacer.repaired(key)
    return [Reason(kind, child, tuple(paths))]


def _announce_repairs(owner: Mapping[str, Any], reasons: list[Reason], trigger: Trigger) -> None:
    if trigger.apply:
        return
    for reason in reasons:
        what = f"{reason.kind} {reason.child}"
        if reason.missing:
            kopf.warn(as_body(owner), reason="Recreating", message=f"{what} is missing; applying it again")
        elif reason.paths:
            paths = ", ".join(reason.paths[:5])
            message = f"{what} was changed outside the operator ({paths}); applying the rendering again"
            kopf.info(as_body(owner), reason="DriftReverted", message=message)


async def _apply(
    owner: Mapping[str, Any],
    manifests: list[dict],
    wanted: list[dict],
    observed: Observed,
    kube: KubeClient,
    trigger: Trigger,
    logger: logging.Logger | logging.LoggerAdapter,
) -> tuple[Problem | None, Observed]:
    """Apply ``wanted``, prune what ``manifests`` dropped; the refusal, and the view with the answers."""
    meta = owner["metadata"]
    outcome = await apply_all(wanted, kube, meta.get("uid"))
    await prune(manifests, kube, meta.get("uid"), outcome)
    problem = outcome.problem()
    if problem is None and outcome.transient:
        raise ApiError(503, f"applying {meta['name']}: {'; '.join(outcome.transient)}")
    applied = outcome.applied
    if problem is None and trigger.announce:
        message = f"{', '.join(applied)} applied for generation {meta.get('generation')}"
        kopf.info(as_body(owner), reason="Applied", message=message)
    logger.info("applied %s to %s/%s", list(applied), meta["namespace"], meta["name"])
    if outcome.deleted:
        kopf.info(
            as_body(owner), reason="Deleted", message=f"{', '.join(outcome.deleted)} {meta['name']}: not in the spec"
        )
    return problem, observed.with_applied(applied.values())


async def _sync_adapters(owner: Mapping[str, Any], spec: PagedLLMSpec, kube: KubeClient, observed: Observed):
    """Bring the ready pods' LoRA adapters to the spec through their API (see :mod:`adapter_sync`)."""
    import aiohttp

    from pagedllm.operator.pod_api import HttpPodApi

    pods = observed.pods or await list_pods(kube, owner)
    key = await _api_key(kube, owner["metadata"]["namespace"], spec)
    async with aiohttp.ClientSession() as session:
        return await sync_adapters(pods, spec.adapters, spec.port, HttpPodApi(session, key))


async def _api_key(kube: KubeClient, namespace: str, spec: PagedLLMSpec) -> str | None:
    """The key the server pods ask for (spec.apiKeySecret), to call their adapter routes."""
    import base64

    ref = spec.api_key_secret
    if ref is None:
        return None
    try:
        secret = await kube.get("Secret", namespace, ref.name)
    except ApiError as exc:
        if exc.retriable:
            raise
        return None  # NOTE: e.g. no grant to read it: the loads then fail with the server's 401, reported
    value = ((secret or {}).get("data") or {}).get(ref.key)
    return base64.b64decode(value).decode() if value else None


async def _write(
    owner: Mapping[str, Any],
    observed: Observed,
    kube: KubeClient,
    problem: Problem | None,
    features: list | None,
    adapters: tuple[PagedLLMSpec, AdapterReport | None] | None = None,
) -> dict:
    """Compute the status and write it if it changed: the one place a ``PagedLLM``'s status is written.

    ``features`` ``None`` (nothing was rendered) keeps the feature conditions as they were;
    ``adapters`` None likewise keeps the adapters' status.
    """
    meta = owner["metadata"]
    stamp = now()
    if problem is None and features is not None:  # NOTE: a LeaderWorkerSet where its CRD is missing: nothing runs
        problem = missing_workload(features)
    status = status_from(owner, observed.workload(owner), now=stamp, problem=problem)
    if features is not None:
        status = with_features(status, features, stamp, lambda outcome: verdict_of(outcome, observed))
    if adapters is not None:
        spec, report = adapters
        status = with_adapters(status, spec.adapters, report, stamp)
    if problem is not None and not _reported(owner, problem):  # NOTE: one warning per problem, not per pass
        kopf.warn(as_body(owner), reason=problem.reason, message=problem.message)
    if status != comparable(owner.get("status"), status):
        announce_phase(owner, status)
        await kube.patch_status(KIND, meta["namespace"], meta["name"], status)
    return status


def verdict_of(outcome: Outcome, observed: Observed) -> Verdict | None:
    """What the live feature object of ``outcome`` says about itself (``None``: nothing to read)."""
    live = observed.get(outcome.kind, outcome.name)
    if live is None:
        return None
    if outcome.kind == "HorizontalPodAutoscaler":
        return hpa_verdict(live)
    if outcome.kind == "ScaledObject":
        return scaled_object_verdict(live)
    if outcome.kind == "InferencePool":
        return pool_verdict(live, observed.picker_slices)
    return None


def _reported(owner: Mapping[str, Any], problem: Problem) -> bool:
    """Whether ``owner``'s status already reports exactly ``problem``."""
    return any(
        cond.get("type") == DEGRADED and cond.get("reason") == problem.reason and cond.get("message") == problem.message
        for cond in (owner.get("status") or {}).get("conditions", []) or []
    )
