"""kopf handlers: a thin layer over :mod:`manifests` (render) and :mod:`status` (observe).

- create / update / resume of a ``PagedLLM``: render, server-side apply, write status.
- events of owned Deployments: refresh the owner's status (phase, conditions, replicas).
- an owned Deployment or Service deleted or edited by hand: apply the owner again
  (recreated, or the edit reverted), and a periodic check for changes no event reported.

A spec the operator cannot serve never raises out of a handler: it becomes a
``Degraded`` condition and a warning event, and waits for the next spec change. Only
transient API trouble is retried (``kopf.TemporaryError``, with exponential backoff);
a refusal of the API (403 no permission, 422 invalid or immutable field, a child another
controller owns) is ``Degraded`` with the API's message. Deleting a resource is left to the
owner references (no finalizer); a fleet object its spec no longer asks for is deleted.
Children are watched through a server-side label selector, not every Deployment.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping
from typing import Any

import kopf

from pagedllm.operator.apply import APPLY_REFUSED, REFUSALS, apply_all, prune
from pagedllm.operator.artifact_events import JOBS, on_job_event
from pagedllm.operator.backoff import Backoff, RepairPacer
from pagedllm.operator.capabilities import servable, with_features
from pagedllm.operator.drift import drifted
from pagedllm.operator.kube import ApiError, KubeClient, collection_path, default_login
from pagedllm.operator.leaderworkerset import LWS_RESOURCE, missing_workload, workload_ref
from pagedllm.operator.manifests import (
    GROUP,
    INSTANCE_LABEL,
    KIND,
    MANAGED_BY,
    PLURAL,
    SERVER_CONTAINER,
    VERSION,
    RenderConfig,
    as_body,
    render,
)
from pagedllm.operator.spec import SpecError
from pagedllm.operator.status import (
    DEGRADED,
    Problem,
    announce_phase,
    comparable,
    desired_replicas,
    owner_name,
    server_exit,
    standing_exit,
    standing_problem,
    status_from,
)

# kopf retries a failed reconcile after RETRY.delay(retry): 10 s, 20 s, 40 s … 5 min.
RETRY = Backoff(base=10, cap=300)
# Recreating a deleted child from its event (kopf does not retry event handlers).
RECREATE = Backoff(base=1, cap=30)
RECREATE_ATTEMPTS = 5
# A child that drifts again right after a repair waits 1 s, 2 s, 4 s … 5 min for the next.
REPAIR = Backoff(base=1, cap=300)
DRIFT_CHECK_SECONDS = 60
INVALID_SPEC = "InvalidSpec"
_MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
MANAGED_SELECTOR = f"app.kubernetes.io/managed-by={MANAGED_BY}"
WATCHED_CHILDREN = (("apps", "v1", "deployments"), ("", "v1", "services"), ("", "v1", "pods"), JOBS)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_registry() -> kopf.OperatorRegistry:
    """All handlers, in a registry of their own (nothing is registered at import time)."""
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry)(login)
    kopf.on.cleanup(registry=registry)(close_client)
    for on_cause in (kopf.on.create, kopf.on.update, kopf.on.resume):
        on_cause(GROUP, VERSION, PLURAL, registry=registry)(reconcile)
    every = DRIFT_CHECK_SECONDS
    kopf.timer(GROUP, VERSION, PLURAL, interval=every, initial_delay=every, registry=registry)(check_drift)
    kopf.on.event("apps", "v1", "deployments", labels=_MANAGED, registry=registry)(on_deployment_event)
    # NOTE: served only where the LeaderWorkerSet CRD is installed; kopf starts the watch when it appears
    kopf.on.event(*LWS_RESOURCE, labels=_MANAGED, registry=registry)(on_deployment_event)
    kopf.on.event("", "v1", "services", labels=_MANAGED, registry=registry)(on_service_event)
    kopf.on.event("", "v1", "pods", labels=_MANAGED, registry=registry)(on_pod_event)
    kopf.on.event(*JOBS, labels=_MANAGED, registry=registry)(on_job_event)
    return registry


def operator_settings() -> kopf.OperatorSettings:
    """kopf settings, fixed at startup."""
    settings = kopf.OperatorSettings()
    # Progress and diff-base in annotations under our own prefix; status stays ours alone
    # (the CRD's status schema is strict, without kopf's fields).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    # Re-establish watches every few minutes; a silently dead stream heals on its own.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    # Only the operator's own children are listed and watched, filtered by the API server.
    for resource in WATCHED_CHILDREN:
        settings.watching.label_selectors[resource] = MANAGED_SELECTOR
    return settings


def make_memo(config: RenderConfig, kube: KubeClient) -> kopf.Memo:
    """What the handlers share: rendering settings, the API client, the drift-repair pacing."""
    return kopf.Memo(config=config, kube=kube, pacer=RepairPacer(REPAIR, time.monotonic))


def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    """kopf's credentials: the same ones :class:`KubeClient` uses."""
    return default_login(settings)


async def close_client(memo: kopf.Memo, **_: Any) -> None:
    await memo.kube.close()


async def reconcile(
    body: kopf.Body, reason: str, patch: kopf.Patch, memo: kopf.Memo, logger: kopf.Logger, retry: int = 0, **_: Any
) -> None:
    """Apply the rendering of ``body`` and record the outcome in its status."""
    status = await converge(body, memo.kube, memo.config, logger, announce=reason != "resume", retry=retry)
    announce_phase(body, status)
    patch.setdefault("status", {}).update(status)


async def converge(
    body: Mapping[str, Any],
    kube: KubeClient,
    config: RenderConfig,
    logger: kopf.Logger,
    *,
    announce: bool = True,
    retry: int = 0,
) -> dict:
    """Render and apply; return the status to write. Raises only ``kopf.TemporaryError``.

    ``retry`` counts the failed attempts before this one; it sets the backoff.
    """
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    try:
        manifests = render(body, config)
    except SpecError as exc:
        return await _degraded(body, kube, Problem(INVALID_SPEC, str(exc)))
    try:
        # Kinds of CRDs the cluster lacks are skipped, and said so in a condition.
        servable_manifests, features = await servable(manifests.all(), kube)
    except ApiError as exc:
        if exc.retriable:
            raise kopf.TemporaryError(f"API discovery for {name}: {exc}", delay=RETRY.delay(retry)) from exc
        return await _degraded(body, kube, Problem(APPLY_REFUSED, f"API discovery for {name}: {exc.message}"))
    outcome = await apply_all(servable_manifests, kube, body["metadata"].get("uid"))
    await prune(manifests.all(), kube, body["metadata"].get("uid"), outcome)
    problem = outcome.problem()
    if problem is not None:
        return await _degraded(body, kube, problem)
    if outcome.transient:
        raise kopf.TemporaryError(f"applying {name}: {'; '.join(outcome.transient)}", delay=RETRY.delay(retry))
    applied = outcome.applied
    if announce:
        kinds = ", ".join(applied)
        kopf.info(
            as_body(body),
            reason="Applied",
            message=f"{kinds} {name} applied for generation {body['metadata'].get('generation')}",
        )
    logger.info("applied %s to %s/%s", list(applied), namespace, name)
    if outcome.deleted:
        kopf.info(as_body(body), reason="Deleted", message=f"{', '.join(outcome.deleted)} {name}: not in the spec")
    # NOTE: read again: the Deployment's status may have moved on while the other children
    # were applied, and this status is written after the event handlers' (newer) ones.
    kind, api_version = manifests.deployment["kind"], manifests.deployment["apiVersion"]
    deployment = await _get_or_none(kube, kind, namespace, name, api_version) or applied.get(kind)
    if deployment is None:  # NOTE: a LeaderWorkerSet where its CRD is missing: nothing runs
        return with_features(await _degraded(body, kube, missing_workload(features)), features, now())
    problem = standing_exit(body, deployment) or await _pods_exit(kube, body, deployment)
    status = status_from(body, deployment, now=now(), problem=problem)
    return with_features(status, features, now())


async def _pods_exit(kube: KubeClient, body: Mapping[str, Any], deployment: Mapping[str, Any]) -> Problem | None:
    """A server exit one of the resource's pods shows now, until every desired replica is ready.

    NOTE: the pod handler reports an exit as it happens; this status is written after it and
    would hide it (``body`` predates it), so it reads the pods too and agrees.
    """
    meta = body["metadata"]
    ready = int((deployment.get("status") or {}).get("readyReplicas") or 0)
    if ready >= desired_replicas(body.get("spec") or {}, deployment):
        return None
    selector = f"{INSTANCE_LABEL}={meta['name']},app.kubernetes.io/managed-by={MANAGED_BY}"
    try:
        pods = await kube.request("GET", collection_path("Pod", meta["namespace"]), query=[("labelSelector", selector)])
    except ApiError:
        return None  # NOTE: the status without it is still true; the pod handler will say it
    exits = (server_exit(pod, SERVER_CONTAINER) for pod in (pods or {}).get("items", []))
    return next((problem for problem in exits if problem is not None), None)


async def _get_or_none(
    kube: KubeClient, kind: str, namespace: str, name: str, api_version: str | None = None
) -> dict | None:
    try:
        return await kube.get(kind, namespace, name, api_version=api_version)
    except ApiError:
        return None


async def _degraded(body: Mapping[str, Any], kube: KubeClient, problem: Problem) -> dict:
    if not _standing(body, problem):  # NOTE: one warning per problem, not one per periodic check
        kopf.warn(as_body(body), reason=problem.reason, message=problem.message)
    meta = body["metadata"]
    # NOTE: even without the Deployment, the status still says what is wrong.
    deployment = await _get_or_none(kube, "Deployment", meta["namespace"], meta["name"])
    return status_from(body, deployment, now=now(), problem=problem)


def refresh_status(body: Mapping[str, Any], deployment: Mapping[str, Any] | None, config: RenderConfig) -> dict:
    """The status of ``body`` given its current Deployment, keeping a standing refusal or server exit."""
    try:
        render(body, config)
    except SpecError as exc:
        return status_from(body, deployment, now=now(), problem=Problem(INVALID_SPEC, str(exc)))
    problem = standing_problem(body, REFUSALS) or standing_exit(body, deployment)
    return status_from(body, deployment, now=now(), problem=problem)


def _standing(body: Mapping[str, Any], problem: Problem) -> bool:
    """Whether ``body``'s status already reports exactly ``problem``."""
    return any(
        cond.get("type") == DEGRADED and cond.get("reason") == problem.reason and cond.get("message") == problem.message
        for cond in (body.get("status") or {}).get("conditions", []) or []
    )


async def _live_owner(body: Mapping[str, Any], kube: KubeClient) -> dict | None:
    name = owner_name(body)
    if name is None:
        return None
    owner = await kube.get(KIND, body["metadata"]["namespace"], name)
    if owner is None or owner.get("metadata", {}).get("deletionTimestamp"):
        return None  # being deleted: its children go with it
    return owner


async def _recreate(owner: dict, what: str, memo: kopf.Memo, logger: kopf.Logger) -> None:
    meta = owner["metadata"]
    kopf.warn(owner, reason="Recreating", message=f"{what} {meta['name']} was deleted; applying it again")
    # NOTE: kopf does not retry event handlers, so transient failures are retried here;
    # the periodic drift check and an operator restart (resume) re-apply everything anyway.
    try:
        await RECREATE.retry(
            lambda: _apply_owner(owner, memo, logger),
            attempts=RECREATE_ATTEMPTS,
            retriable=lambda exc: isinstance(exc, kopf.TemporaryError) or (isinstance(exc, ApiError) and exc.retriable),
        )
    except (kopf.TemporaryError, ApiError) as exc:
        kopf.warn(
            owner,
            reason="RecreateFailed",
            message=f"{what} {meta['name']} could not be recreated ({exc}); the next periodic check tries again",
        )


async def _apply_owner(owner: Mapping[str, Any], memo: kopf.Memo, logger: kopf.Logger) -> None:
    """Converge ``owner`` outside its own handlers and write its status."""
    meta = owner["metadata"]
    status = await converge(owner, memo.kube, memo.config, logger, announce=False)
    announce_phase(owner, status)
    await memo.kube.patch_status(KIND, meta["namespace"], meta["name"], status)


async def repair_drift(
    owner: Mapping[str, Any], live: Mapping[str, Any], kind: str, memo: kopf.Memo, logger: kopf.Logger
) -> bool:
    """Apply ``owner`` again if its child ``live`` no longer matches the rendering; True if it did."""
    try:
        rendered = render(owner, memo.config).all()
    except SpecError:
        return False  # nothing to repair towards; the status already says why
    name = live["metadata"]["name"]
    desired = next((m for m in rendered if m["kind"] == kind and m["metadata"]["name"] == name), None)
    key = (kind, live["metadata"].get("namespace"), name)
    paths = drifted(desired, live) if desired is not None else []
    if not paths:
        memo.pacer.settled(key)
        return False
    if not memo.pacer.due(key):
        logger.info("%s %s drifted again (%s); repair postponed (backoff)", kind, name, ", ".join(paths))
        return True
    memo.pacer.repaired(key)
    message = f"{kind} {name} was changed outside the operator ({', '.join(paths[:5])}); applying the rendering again"
    kopf.info(as_body(owner), reason="DriftReverted", message=message)
    try:
        await _apply_owner(owner, memo, logger)
    except (kopf.TemporaryError, ApiError) as exc:
        logger.warning("reverting %s %s failed (%s); the periodic check tries again", kind, name, exc)
    return True


async def check_drift(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Periodically: repair or recreate a Deployment or Service whose change no event reported."""
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return
    for kind, api_version in (workload_ref(body.get("spec") or {}), ("Service", None)):
        live = await memo.kube.get(kind, meta["namespace"], meta["name"], api_version=api_version)
        if live is None or owner_name(live) != meta["name"]:
            # Missing (or never applied: a standing refusal is retried here, once a period).
            await _apply_owner(body, memo, logger)
            return
        if await repair_drift(body, live, kind, memo, logger):
            return


async def on_deployment_event(
    type: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """An owned Deployment (or LeaderWorkerSet) changed: refresh the owner's status, or recreate it if deleted."""
    owner = await _live_owner(body, memo.kube)
    if owner is None:
        return
    kind = body.get("kind") or "Deployment"
    if type == "DELETED":
        await _recreate(owner, kind, memo, logger)
        return
    if type == "MODIFIED" and await repair_drift(owner, body, kind, memo, logger):
        return
    status = refresh_status(owner, body, memo.config)
    if status != comparable(owner.get("status"), status):
        announce_phase(owner, status)
        await memo.kube.patch_status(KIND, owner["metadata"]["namespace"], owner["metadata"]["name"], status)


async def on_service_event(type: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """An owned Service was deleted or edited: apply its owner again."""
    if type not in ("DELETED", "MODIFIED"):
        return
    owner = await _live_owner(body, memo.kube)
    if owner is None:
        return
    if type == "DELETED":
        await _recreate(owner, "Service", memo, logger)
    else:
        await repair_drift(owner, body, "Service", memo, logger)


async def on_pod_event(type: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """A server pod exited with an error: say why on its ``PagedLLM`` (``Degraded``)."""
    problem = server_exit(body, SERVER_CONTAINER)
    if type == "DELETED" or problem is None:
        return
    meta = body.get("metadata", {})
    name = (meta.get("labels") or {}).get(INSTANCE_LABEL)
    if not name:
        return
    owner = await memo.kube.get(KIND, meta["namespace"], name)
    if owner is None or owner.get("metadata", {}).get("deletionTimestamp"):
        return
    deployment = await memo.kube.get("Deployment", meta["namespace"], name)
    status = status_from(owner, deployment, now=now(), problem=problem)
    if status != comparable(owner.get("status"), status):
        logger.warning("%s", problem.message)
        announce_phase(owner, status)
        await memo.kube.patch_status(KIND, meta["namespace"], name, status)
