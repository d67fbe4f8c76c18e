"""kopf handlers: thin triggers of the one reconcile (:mod:`reconcile`).

- create / update / resume of a ``PagedLLM``: reconcile, applying the whole rendering.
- events of its children (Deployment, Service, server pods, autoscaler): reconcile the
  owner, which reports their state and recreates or reverts a child deleted or edited by
  hand; a periodic check does the same for changes no event reported.

No handler computes or writes status itself: the reconcile is the only writer, one pass
at a time per owner (:class:`~pagedllm.operator.owner_gate.OwnerGate`).

A spec the operator cannot serve never raises out of a handler: it becomes a
``Degraded`` condition and a warning event, and waits for the next spec change. Only
transient API trouble is retried (``kopf.TemporaryError``, with exponential backoff);
a refusal of the API (403 no permission, 422 invalid or immutable field, a child another
controller owns) is ``Degraded`` with the API's message. Deleting a resource is left to the
owner references (no finalizer); a fleet object its spec no longer asks for is deleted.
Children are watched through a server-side label selector, not every Deployment.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import kopf

from pagedllm.operator.artifact_events import JOBS, on_job_event
from pagedllm.operator.autoscaling import HPA, KEDA
from pagedllm.operator.backoff import Backoff, RepairPacer
from pagedllm.operator.kopf_session import session_login
from pagedllm.operator.kube import ApiError, KubeClient, default_login
from pagedllm.operator.leaderworkerset import LWS_RESOURCE
from pagedllm.operator.manifests import GROUP, INSTANCE_LABEL, MANAGED_BY, PLURAL, VERSION, RenderConfig
from pagedllm.operator.metrics import OperatorMetrics
from pagedllm.operator.owner_gate import OwnerGate
from pagedllm.operator.policy import AdminPolicy
from pagedllm.operator.reconcile import RETRY, Trigger, reconcile
from pagedllm.operator.status import owner_name

__all__ = ["RETRY", "build_registry", "make_memo", "operator_settings"]

# An event's reconcile failing on transient API trouble (kopf does not retry event handlers).
EVENT_RETRY = Backoff(base=1, cap=30)
EVENT_ATTEMPTS = 5
# A child that drifts again right after a repair waits 1 s, 2 s, 4 s … 5 min for the next.
REPAIR = Backoff(base=1, cap=300)
DRIFT_CHECK_SECONDS = 60
_MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
MANAGED_SELECTOR = f"app.kubernetes.io/managed-by={MANAGED_BY}"
WATCHED_CHILDREN = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "pods"),
    ("autoscaling", "v2", "horizontalpodautoscalers"),
    # NOTE: a NetworkPolicy opened by hand is closed again at once, not at the next periodic check.
    ("networking.k8s.io", "v1", "networkpolicies"),
    # NOTE: the EndpointSlice controller copies a Service's labels onto its slices, so the
    # deployed endpoint picker's slices carry the managed-by and instance labels.
    ("discovery.k8s.io", "v1", "endpointslices"),
    # Kinds of optional CRDs: kopf watches them once the CRD exists (a warning until then).
    ("inference.networking.k8s.io", "v1", "inferencepools"),
    LWS_RESOURCE,
)
KEDA_CHILDREN = (("keda.sh", "v1alpha1", "scaledobjects"),)


def build_registry(autoscaler: str = HPA) -> kopf.OperatorRegistry:
    """All handlers, in a registry of their own (nothing is registered at import time).

    ScaledObjects are watched only with the KEDA autoscaler (the hpa mode may not list them).
    """
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry)(login)
    kopf.on.cleanup(registry=registry)(close_client)
    for on_cause in (kopf.on.create, kopf.on.update, kopf.on.resume):
        on_cause(GROUP, VERSION, PLURAL, registry=registry)(on_spec)
    every = DRIFT_CHECK_SECONDS
    kopf.timer(GROUP, VERSION, PLURAL, interval=every, initial_delay=every, registry=registry)(check_periodically)
    for group, version, plural in WATCHED_CHILDREN + (KEDA_CHILDREN if autoscaler == KEDA else ()):
        kopf.on.event(group, version, plural, labels=_MANAGED, registry=registry)(on_child_event)
    # NOTE: a download Job's progress goes to status.model through its own handler (see artifact_events)
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
    for resource in WATCHED_CHILDREN + KEDA_CHILDREN + (JOBS,):
        settings.watching.label_selectors[resource] = MANAGED_SELECTOR
    return settings


def make_memo(
    config: RenderConfig, kube: KubeClient, metrics: OperatorMetrics | None = None, policy: AdminPolicy = AdminPolicy()
) -> kopf.Memo:
    """What the handlers share: rendering settings, the API client, the drift-repair pacing, the owners'
    turns, the operator's metrics and the admin's allow-lists."""
    return kopf.Memo(
        config=config,
        kube=kube,
        policy=policy,
        pacer=RepairPacer(REPAIR, time.monotonic),
        gate=OwnerGate(),
        metrics=metrics or OperatorMetrics(),
    )


async def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.AiohttpSession:
    """kopf's credentials: the same ones :class:`KubeClient` uses, in a session that logs the API server's
    warnings to kopf's own writes (status, progress, events); made here, on the operator's event loop."""
    return session_login(default_login(settings))


async def close_client(memo: kopf.Memo, **_: Any) -> None:
    await memo.kube.close()


async def _run(
    memo: kopf.Memo, logger: Any, namespace: str, name: str, trigger: Trigger, *, fold: bool, cause: str
) -> None:
    """One reconcile of ``namespace/name`` in its turn, counted in the metrics under ``cause``."""

    async def action() -> dict | None:
        started, result = time.monotonic(), "error"
        try:
            status = await reconcile(namespace, name, memo.kube, memo.config, memo.pacer, logger, trigger, memo.policy)
            result = "ok"
        except kopf.TemporaryError:
            result = "retry"
            raise
        finally:
            memo.metrics.passed(cause, result, time.monotonic() - started)
        memo.metrics.phase((namespace, name), (status or {}).get("phase"))
        return status

    await memo.gate.run((namespace, name), action, fold=fold)


async def on_spec(body: kopf.Body, reason: str, memo: kopf.Memo, logger: kopf.Logger, retry: int = 0, **_: Any) -> None:
    """The spec was created or changed, or the operator resumed: apply the whole rendering."""
    meta = body["metadata"]
    trigger = Trigger(apply=True, announce=reason != "resume", retry=retry)
    await _run(memo, logger, meta["namespace"], meta["name"], trigger, fold=False, cause="spec")


async def check_periodically(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Periodically: what no event reported (a missing or edited child, a refusal worth asking again)."""
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return
    await _run(memo, logger, meta["namespace"], meta["name"], Trigger(retry_refused=True), fold=True, cause="periodic")


def owner_of(body: Mapping[str, Any]) -> str | None:
    """The ``PagedLLM`` a child belongs to: its controller reference, else (pods) its instance label."""
    name = owner_name(body)
    if name is not None:
        return name
    labels = body.get("metadata", {}).get("labels") or {}
    return labels.get(INSTANCE_LABEL) if labels.get("app.kubernetes.io/managed-by") == MANAGED_BY else None


async def on_child_event(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """A child or server pod changed, appeared or went: reconcile its owner.

    NOTE: kopf does not retry event handlers, so transient failures are retried here; the
    periodic check and an operator restart (resume) reconcile everything anyway.
    """
    name = owner_of(body)
    if name is None:
        return
    namespace = body["metadata"]["namespace"]
    try:
        await EVENT_RETRY.retry(
            lambda: _run(memo, logger, namespace, name, Trigger(), fold=True, cause="event"),
            attempts=EVENT_ATTEMPTS,
            retriable=lambda exc: isinstance(exc, kopf.TemporaryError),
        )
    except (kopf.TemporaryError, kopf.PermanentError, ApiError) as exc:
        logger.warning(
            "reconciling %s/%s after a child's event failed (%s); the periodic check tries again", namespace, name, exc
        )
