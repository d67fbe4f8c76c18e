"""Trouble a real API server gives its clients, for the emulated one to inject on demand.

- :meth:`Chaos.fail_next`: the next N matching requests of the operator are answered with a
  status instead of being served: 409 Conflict (``the object has been modified``, as for a
  stale ``resourceVersion``), 429 Too Many Requests (with ``Retry-After``, as API Priority
  and Fairness answers), 500/503;
- :meth:`Chaos.drop_watches`: every open watch stream ends now, as when the API server
  restarts or a load balancer cuts idle connections;
- :meth:`Chaos.expire`: every ``resourceVersion`` given out so far becomes too old: a watch
  from one of them gets a single ``ERROR`` event with a 410 Gone Status (the client must
  list again), as after etcd's compaction.

:class:`WatchServing` serves lists and watches with real ``resourceVersion`` numbers (kmock
answers ``...``) and honours the last two.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp.web
import attrs
import kmock

DROP = "__drop__"  # a bus event that ends the watches reading it
REASONS = {409: "Conflict", 410: "Gone", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable"}


def status_body(code: int, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": REASONS.get(code, ""),
        "code": code,
    }


@dataclass
class _Fault:
    code: int
    left: int
    method: str | None
    path_prefix: str


@dataclass
class Chaos:
    """Faults waiting to be served, and the oldest ``resourceVersion`` still valid."""

    faults: list[_Fault] = field(default_factory=list)
    oldest_valid: int = 0
    served: list[str] = field(default_factory=list)  # "CODE METHOD PATH" of every fault served

    def fail_next(self, count: int, code: int, method: str | None = None, path_prefix: str = "") -> None:
        self.faults.append(_Fault(code, count, method, path_prefix))

    def pending(self) -> int:
        return sum(f.left for f in self.faults)

    def fault_for(self, method: str, path: str) -> aiohttp.web.Response | None:
        for fault in self.faults:
            if fault.left and (fault.method in (None, method)) and path.startswith(fault.path_prefix):
                fault.left -= 1
                self.served.append(f"{fault.code} {method} {path}")
                return self._answer(fault.code)
        return None

    @staticmethod
    def _answer(code: int) -> aiohttp.web.Response:
        message = {
            409: "Operation cannot be fulfilled: the object has been modified; please apply your changes "
            "to the latest version and try again",
            429: "Too many requests, please try again later.",
        }.get(code, "the server is currently unable to handle the request")
        headers = {"Retry-After": "1"} if code == 429 else {}
        return aiohttp.web.json_response(status_body(code, message), status=code, headers=headers)


@attrs.define(kw_only=True)
class WatchServing(kmock.KubernetesEmulator):
    """Lists and watches with resourceVersions, watch streams that can be cut, and 410 Gone."""

    chaos: Chaos = attrs.field(factory=Chaos, init=False)
    _versions: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    _last_version: int = attrs.field(default=0, init=False)

    def next_version(self) -> str:
        self._last_version = next(self._versions)
        return str(self._last_version)

    async def drop_watches(self) -> None:
        for bus in list(self._buses.values()):
            await bus.put({"type": DROP})

    async def _serve_list(self, request: kmock.Request):
        listed = await super()._serve_list(request)
        listed["metadata"]["resourceVersion"] = str(self._last_version)
        return listed

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        yield b""
        since = request.params.get("resourceVersion") or ""
        if since.isdigit() and int(since) < self.chaos.oldest_valid:
            self.chaos.served.append(f"410 WATCH {request.url.path}")
            message = f"too old resource version: {since} ({self.chaos.oldest_valid})"
            yield {"type": "ERROR", "object": status_body(410, message)}
            return
        async with self._lock:
            events = [
                {"type": "ADDED", "object": obj.raw}
                for (resource, namespace, name), obj in list(self.objects.items())
                if resource == request.resource and self._watched(request, namespace, name) and not obj.deleted
            ]
        for event in events:
            yield event
        assert request.resource is not None
        async for event in self._buses[request.resource]:
            if event.get("type") == DROP:
                return
            meta = event.get("object", {}).get("metadata", {})
            if self._watched(request, meta.get("namespace"), meta.get("name")):
                yield event

    @staticmethod
    def _watched(request: kmock.Request, namespace: str | None, name: str | None) -> bool:
        return (request.namespace is None or namespace == request.namespace) and (
            request.name is None or name == request.name
        )
