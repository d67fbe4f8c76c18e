"""kopf handlers: a thin layer over :mod:`manifests` (render) and :mod:`status` (observe).

- create / update / resume of a ``PagedLLM``: render, server-side apply, write status.
- events of owned Deployments: refresh the owner's status (phase, conditions, replicas).
- an owned Deployment or Service deleted by hand: apply the owner again (recreated).

A spec the operator cannot serve never raises out of a handler: it becomes a
``Degraded`` condition and a warning event, and waits for the next spec change. Only
transient API trouble is retried (``kopf.TemporaryError``). Deletion is left to the
owner references (no finalizer, so removing the operator never blocks a delete).
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Mapping
from typing import Any

import kopf

from pagedllm.operator.kube import ApiError, KubeClient, default_login
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
from pagedllm.operator.status import DEGRADED, Problem, server_exit, status_from

RETRY_DELAY_SECONDS = 10
RECREATE_BACKOFF_SECONDS = (1, 2, 4, 8)
APPLY_REFUSED = "ApplyRefused"
INVALID_SPEC = "InvalidSpec"
_MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_registry() -> kopf.OperatorRegistry:
    """All handlers, in a registry of their own (nothing is registered at import time)."""
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry)(login)
    kopf.on.cleanup(registry=registry)(close_client)
    for on_cause in (kopf.on.create, kopf.on.update, kopf.on.resume):
        on_cause(GROUP, VERSION, PLURAL, registry=registry)(reconcile)
    kopf.on.event("apps", "v1", "deployments", labels=_MANAGED, registry=registry)(on_deployment_event)
    kopf.on.event("", "v1", "services", labels=_MANAGED, registry=registry)(on_service_event)
    kopf.on.event("", "v1", "pods", labels=_MANAGED, registry=registry)(on_pod_event)
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
    return settings


def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    """kopf's credentials: the same ones :class:`KubeClient` uses."""
    return default_login(settings)


async def close_client(memo: kopf.Memo, **_: Any) -> None:
    await memo.kube.close()


async def reconcile(
    body: kopf.Body, reason: str, patch: kopf.Patch, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """Apply the rendering of ``body`` and record the outcome in its status."""
    status = await converge(body, memo.kube, memo.config, logger, announce=reason != "resume")
    announce_phase(body, status)
    patch.setdefault("status", {}).update(status)


async def converge(
    body: Mapping[str, Any], kube: KubeClient, config: RenderConfig, logger: kopf.Logger, *, announce: bool = True
) -> dict:
    """Render and apply; return the status to write. Raises only ``kopf.TemporaryError``."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    try:
        manifests = render(body, config)
    except SpecError as exc:
        return await _degraded(body, kube, Problem(INVALID_SPEC, str(exc)))
    applied = {}
    try:
        for manifest in manifests.all():
            applied[manifest["kind"]] = await kube.apply(manifest)
    except ApiError as exc:
        if exc.retriable:
            raise kopf.TemporaryError(f"applying {manifest['kind']} {name}: {exc}", delay=RETRY_DELAY_SECONDS) from exc
        return await _degraded(body, kube, Problem(APPLY_REFUSED, f"{manifest['kind']} {name}: {exc.message}"))
    if announce:
        kinds = ", ".join(applied)
        kopf.info(
            as_body(body),
            reason="Applied",
            message=f"{kinds} {name} applied for generation {body['metadata'].get('generation')}",
        )
    logger.info("applied %s to %s/%s", list(applied), namespace, name)
    return status_from(body, applied["Deployment"], now=now())


async def _degraded(body: Mapping[str, Any], kube: KubeClient, problem: Problem) -> dict:
    kopf.warn(as_body(body), reason=problem.reason, message=problem.message)
    meta = body["metadata"]
    try:
        deployment = await kube.get("Deployment", meta["namespace"], meta["name"])
    except ApiError:
        deployment = None  # the status still says what is wrong with the spec
    return status_from(body, deployment, now=now(), problem=problem)


def refresh_status(body: Mapping[str, Any], deployment: Mapping[str, Any] | None, config: RenderConfig) -> dict:
    """The status of ``body`` given its current Deployment, keeping a standing refusal."""
    try:
        render(body, config)
    except SpecError as exc:
        return status_from(body, deployment, now=now(), problem=Problem(INVALID_SPEC, str(exc)))
    return status_from(body, deployment, now=now(), problem=_standing_refusal(body))


def _standing_refusal(body: Mapping[str, Any]) -> Problem | None:
    """An apply refused for the current generation stays until the spec changes."""
    generation = body.get("metadata", {}).get("generation")
    for cond in (body.get("status") or {}).get("conditions", []) or []:
        if (
            cond.get("type") == DEGRADED
            and cond.get("status") == "True"
            and cond.get("reason") == APPLY_REFUSED
            and cond.get("observedGeneration") == generation
        ):
            return Problem(APPLY_REFUSED, cond.get("message", ""))
    return None


def owner_name(body: Mapping[str, Any]) -> str | None:
    """The ``PagedLLM`` that controls this object, if any."""
    for ref in body.get("metadata", {}).get("ownerReferences", []) or []:
        if ref.get("kind") == KIND and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/"):
            return ref.get("name")
    return None


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
    # an operator restart re-applies everything anyway (resume).
    for delay in RECREATE_BACKOFF_SECONDS:
        try:
            status = await converge(owner, memo.kube, memo.config, logger, announce=False)
            announce_phase(owner, status)
            await memo.kube.patch_status(KIND, meta["namespace"], meta["name"], status)
            return
        except (kopf.TemporaryError, ApiError) as exc:
            logger.warning("recreating %s %s failed (%s); retrying in %ss", what, meta["name"], exc, delay)
            await asyncio.sleep(delay)
    kopf.warn(
        owner,
        reason="RecreateFailed",
        message=f"{what} {meta['name']} could not be recreated; it will be on the next change or operator restart",
    )


async def on_deployment_event(
    type: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """An owned Deployment changed: refresh the owner's status, or recreate it if deleted."""
    owner = await _live_owner(body, memo.kube)
    if owner is None:
        return
    if type == "DELETED":
        await _recreate(owner, "Deployment", memo, logger)
        return
    status = refresh_status(owner, body, memo.config)
    if status != _comparable(owner.get("status"), status):
        announce_phase(owner, status)
        await memo.kube.patch_status(KIND, owner["metadata"]["namespace"], owner["metadata"]["name"], status)


async def on_service_event(type: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """An owned Service was deleted: apply its owner again."""
    if type != "DELETED":
        return
    owner = await _live_owner(body, memo.kube)
    if owner is not None:
        await _recreate(owner, "Service", memo, logger)


def _comparable(current: Mapping[str, Any] | None, wanted: Mapping[str, Any]) -> dict:
    """The current status restricted to the keys we write, to skip no-op patches."""
    current = current or {}
    return {key: current.get(key) for key in wanted}


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
    if status != _comparable(owner.get("status"), status):
        logger.warning("%s", problem.message)
        announce_phase(owner, status)
        await memo.kube.patch_status(KIND, meta["namespace"], name, status)


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
