"""Leader election on a ``coordination.k8s.io/v1`` Lease: of several operator replicas, one reconciles.

kopf's peering is not leader election: operators of equal priority all pause, and the
chart would need kopf's peering CRDs. This is the Lease protocol of client-go's
``leaderelection`` (and of kube-controller-manager), asynchronous so it shares the
operator's event loop::

    candidate   every retry_period: get the Lease; take it if absent, released, ours, or unchanged
                for lease_duration by this replica's own monotonic clock; else wait
    leader      every retry_period: renew (renewTime = now); a renewal that has not succeeded
                for renew_deadline means another replica may take over: stop reconciling
    stopping    a leader stopped on purpose (SIGTERM, a rollout) empties holderIdentity, so a
                standby takes over at once instead of after lease_duration

Every write carries the ``resourceVersion`` it read, so of two candidates racing for an
expired Lease the API server accepts one (the other gets 409 Conflict and stays a
candidate). ``renew_deadline < lease_duration`` leaves the old leader time to stop
before anyone else may start.

NOTE: expiry is timed by observation, as client-go does: a candidate records when it last
saw the Lease's record change (holder, renewTime, transitions, ...) on its own monotonic
clock, and takes the Lease only once ``leaseDurationSeconds`` have passed since then. The
holder's ``renewTime`` is a stamp of another machine's clock and is never compared with this
one's: with skewed clocks, comparing them lets two replicas lead at once (a candidate whose
clock runs ahead sees a live Lease as expired). The price: a new candidate waits one
lease_duration after its first look, even at a Lease long abandoned.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pagedllm.operator.kube import ApiError

LEASES = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
MICRO_TIME = "%Y-%m-%dT%H:%M:%S.%fZ"


class Api(Protocol):
    async def request(
        self, method: str, path: str, *, body: Any = None, query: list | None = None, content_type: str = ""
    ) -> Any: ...


@dataclass(frozen=True)
class LeaseConfig:
    """Which Lease, who is asking, and the protocol's timings (seconds, client-go's defaults)."""

    namespace: str
    """Namespace of the Lease (the operator's own)."""
    identity: str
    """This replica (its pod name)."""
    name: str = "pagedllm-operator"
    """Name of the Lease."""
    lease_duration: float = 15.0
    """How long a Lease not renewed stays its holder's."""
    renew_deadline: float = 10.0
    """How long the leader keeps leading without a successful renewal."""
    retry_period: float = 2.0
    """Between two attempts to take or renew the Lease."""

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                f"lease timings retry_period={self.retry_period}, renew_deadline={self.renew_deadline}, "
                f"lease_duration={self.lease_duration} are not allowed: need 0 < retry < renew_deadline < duration"
            )


def _stamp(when: datetime.datetime) -> str:
    return when.strftime(MICRO_TIME)


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class LeaderElector:
    """Takes and keeps the Lease of :class:`LeaseConfig` for this replica."""

    def __init__(
        self,
        api: Api,
        config: LeaseConfig,
        clock: Callable[[], datetime.datetime] = _utcnow,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        """``clock`` stamps what this replica writes (for people to read); ``monotonic`` times the expiry."""
        self._api, self._config, self._clock, self._monotonic = api, config, clock, monotonic
        self._observed: dict | None = None
        """The Lease's record as last seen (or written) by this replica."""
        self._observed_at = 0.0
        """When (``monotonic``) that record was first seen."""

    @property
    def _collection(self) -> str:
        return LEASES.format(namespace=self._config.namespace)

    async def try_acquire_or_renew(self) -> bool:
        """One attempt: True if this replica holds the Lease afterwards."""
        cfg = self._config
        try:
            lease = await self._api.request("GET", f"{self._collection}/{cfg.name}")
        except ApiError as exc:
            if exc.status != 404:
                raise
            return await self._write("POST", self._collection, self._lease(None))
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        if holder and holder != cfg.identity and not self._expired(spec):
            return False
        return await self._write("PATCH", f"{self._collection}/{cfg.name}", self._lease(lease))

    def _expired(self, spec: dict) -> bool:
        """Whether ``spec`` has stayed unchanged for its lease duration, by this replica's observation."""
        now = self._monotonic()
        if spec != self._observed:
            self._observed, self._observed_at = dict(spec), now
            return False
        duration = spec.get("leaseDurationSeconds") or self._config.lease_duration
        return now - self._observed_at > duration

    def _lease(self, current: dict | None) -> dict:
        cfg, now = self._config, _stamp(self._clock())
        spec = (current or {}).get("spec") or {}
        ours = spec.get("holderIdentity") == cfg.identity
        new_spec = {
            "holderIdentity": cfg.identity,
            "leaseDurationSeconds": int(cfg.lease_duration),
            "acquireTime": spec.get("acquireTime") if ours else now,
            "renewTime": now,
            "leaseTransitions": int(spec.get("leaseTransitions") or 0) + (0 if ours or current is None else 1),
        }
        metadata: dict[str, Any] = {"name": cfg.name, "namespace": cfg.namespace}
        if current is not None:
            # NOTE: the precondition that lets only one of two racing candidates win.
            metadata["resourceVersion"] = current["metadata"]["resourceVersion"]
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": new_spec}

    async def _write(self, method: str, path: str, lease: dict) -> bool:
        content_type = "application/merge-patch+json" if method == "PATCH" else "application/json"
        try:
            await self._api.request(method, path, body=lease, content_type=content_type)
        except ApiError as exc:
            if exc.status == 409:  # another replica wrote first
                return False
            raise
        self._observed, self._observed_at = dict(lease.get("spec") or {}), self._monotonic()
        return True

    async def release(self) -> None:
        """Give the Lease up if this replica holds it, so a standby takes over at once (a clean stop).

        NOTE: best effort: if this fails, the Lease simply expires.
        """
        cfg = self._config
        try:
            lease = await self._api.request("GET", f"{self._collection}/{cfg.name}")
            if (lease.get("spec") or {}).get("holderIdentity") != cfg.identity:
                return
            released = {
                "metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                "spec": {"holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": _stamp(self._clock())},
            }
            await self._write("PATCH", f"{self._collection}/{cfg.name}", released)
        except ApiError:
            return

    async def acquire(self, sleep: Callable[[float], Any] = asyncio.sleep) -> None:
        """Return once this replica holds the Lease (transient API errors are waited out)."""
        while not await self._attempt():
            await sleep(self._config.retry_period)

    async def _attempt(self) -> bool:
        try:
            return await self.try_acquire_or_renew()
        except ApiError as exc:
            if not exc.retriable:
                raise
            return False

    async def keep(self, monotonic: Callable[[], float], sleep: Callable[[float], Any] = asyncio.sleep) -> None:
        """Renew until a renewal has failed for ``renew_deadline``; then return (leadership lost)."""
        last = monotonic()
        while monotonic() - last < self._config.renew_deadline:
            await sleep(self._config.retry_period)
            if await self._attempt():
                last = monotonic()
