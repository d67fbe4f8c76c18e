"""LoRA adapters at run time: every ready server pod is brought to ``spec.adapters`` through its API.

One pass, for each ready pod that serves HTTP (a LeaderWorkerSet's leaders only)::

    GET  /v1/models               the adapters it holds: cards with a parent, path in ``root``
    POST /v1/unload_lora_adapter  each one held that the spec no longer lists (or lists at another path)
    POST /v1/load_lora_adapter    each one the spec lists that it does not hold

New pods read the list at start (the adapters ConfigMap, :mod:`adapters`), so this only
catches up pods that were running when the list changed, or that started before the
ConfigMap did. The outcome is ``status.adapters`` (per adapter, per pod) and the
``AdaptersReady`` condition, whose message carries the server's own when a load fails.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pagedllm.operator.adapters import Adapter
from pagedllm.operator.leaderworkerset import WORKER_INDEX_LABEL

CONDITION = "AdaptersReady"
LOADED, FAILED = "Loaded", "Failed"


class PodApiError(Exception):
    """A pod's API refused or did not answer; the message is the server's (or the connection's)."""


class PodApi(Protocol):
    async def models(self, base: str) -> list[dict]: ...

    async def load(self, base: str, name: str, path: str) -> None: ...

    async def unload(self, base: str, name: str) -> None: ...


@dataclass(frozen=True)
class PodState:
    """One adapter on one pod."""

    adapter: str
    pod: str
    state: str
    message: str = ""


@dataclass(frozen=True)
class AdapterReport:
    """What a pass found and did on the ready pods."""

    states: tuple[PodState, ...] = ()
    pods: tuple[str, ...] = ()
    unload_errors: tuple[str, ...] = ()

    def status(self, adapters: tuple[Adapter, ...]) -> list[dict]:
        """``status.adapters``: per adapter, how many ready pods hold it and each pod's state."""
        out = []
        for adapter in adapters:
            rows = [s for s in self.states if s.adapter == adapter.name]
            loaded = sum(1 for s in rows if s.state == LOADED)
            pods = [{"name": s.pod, "state": s.state, **({"message": s.message} if s.message else {})} for s in rows]
            out.append({"name": adapter.name, "loaded": f"{loaded}/{len(self.pods)}", "pods": pods})
        return out

    def condition(self) -> tuple[str, str, str]:
        """(status, reason, message) of ``AdaptersReady``."""
        failed = [s for s in self.states if s.state == FAILED]
        if failed:
            first = failed[0]
            more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            return "False", "AdapterLoadFailed", f"adapter {first.adapter} on pod {first.pod}: {first.message}{more}"
        if self.unload_errors:
            return "False", "AdapterUnloadFailed", self.unload_errors[0]
        if not self.pods:
            return "Unknown", "NoReadyPod", "no server pod is ready: pods load the adapters when they start"
        count = len({s.adapter for s in self.states})
        return "True", "AdaptersLoaded", f"{count} adapter(s) loaded on {len(self.pods)} ready pod(s)"


def ready_server_pods(pods: tuple[dict, ...]) -> list[dict]:
    """Pods that answer HTTP now: ready, with an IP, not terminating, not a group's worker."""
    out = []
    for pod in pods:
        meta, status = pod.get("metadata", {}), pod.get("status") or {}
        if meta.get("deletionTimestamp") or not status.get("podIP"):
            continue
        if (meta.get("labels") or {}).get(WORKER_INDEX_LABEL, "0") != "0":
            continue
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        if conditions.get("Ready") == "True":
            out.append(pod)
    return sorted(out, key=lambda p: p["metadata"]["name"])


async def sync_adapters(pods: tuple[dict, ...], adapters: tuple[Adapter, ...], port: int, api: PodApi) -> AdapterReport:
    """Load and unload on every ready pod of ``pods`` until each holds exactly ``adapters``."""
    states: list[PodState] = []
    unload_errors: list[str] = []
    ready = ready_server_pods(pods)
    for pod in ready:
        name = pod["metadata"]["name"]
        base = f"http://{_host(pod['status']['podIP'])}:{port}"
        try:
            held = {c["id"]: c.get("root") for c in await api.models(base) if c.get("parent")}
        except PodApiError as exc:
            states += [PodState(a.name, name, FAILED, f"listing its adapters: {exc}") for a in adapters]
            continue
        wanted = {a.name: a.path for a in adapters}
        for stale in [n for n, path in held.items() if wanted.get(n) != path]:
            try:
                await api.unload(base, stale)
                del held[stale]
            except PodApiError as exc:
                unload_errors.append(f"adapter {stale} on pod {name}: {exc}")
        for adapter in adapters:
            states.append(await _load(api, base, name, adapter, held))
    return AdapterReport(tuple(states), tuple(p["metadata"]["name"] for p in ready), tuple(unload_errors))


async def _load(api: PodApi, base: str, pod: str, adapter: Adapter, held: Mapping[str, Any]) -> PodState:
    if held.get(adapter.name) == adapter.path:
        return PodState(adapter.name, pod, LOADED)
    try:
        await api.load(base, adapter.name, adapter.path)
    except PodApiError as exc:
        return PodState(adapter.name, pod, FAILED, str(exc))
    return PodState(adapter.name, pod, LOADED)


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def with_adapters(status: Mapping[str, Any], adapters: tuple[Adapter, ...], report: AdapterReport | None, now: str):
    """``status`` with ``adapters`` and the ``AdaptersReady`` condition; ``report`` None (LoRA off) drops both."""
    conditions = [c for c in status.get("conditions") or [] if c.get("type") != CONDITION]
    if report is None:
        return {**status, "conditions": conditions, "adapters": None}
    old: Mapping[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == CONDITION), {})
    state, reason, message = report.condition()
    since = old.get("lastTransitionTime", now) if old.get("status") == state else now
    cond = {"type": CONDITION, "status": state, "reason": reason, "message": message, "lastTransitionTime": since}
    return {**status, "conditions": [*conditions, cond], "adapters": report.status(adapters)}
