"""A Kubernetes API for the operator tests: kmock's ``KubernetesEmulator`` over real HTTP.

kmock 0.8 stores objects as given and merges patches. The operator relies on things a
real API server does and kmock does not, which :class:`ApiServer` adds, layer by layer:

- trouble on demand (:mod:`api_chaos`): 409/429/5xx answers to the operator's next
  requests, watch streams cut, 410 Gone on a watch from an expired resourceVersion;
- admission (:mod:`api_admission`): RBAC from the chart's rendered roles (403, refusals
  kept: :meth:`EmulatedCluster.denials`); every write checked against its kind's schema
  (:mod:`api_schemas`: ``kubernetes-validate``'s or a CRD's) and refused with 422 Invalid;
  ``fieldValidation`` honoured (``Strict``: an unknown field is a 422; ``Warn``, the
  default: dropped, with a ``Warning: 299 - "unknown field \\"spec.foo\\""`` header; ``Ignore``:
  dropped); defaults filled in, the CRD schemas' and the built-in kinds'
  (:mod:`builtin_defaults`: a Deployment's ``strategy``, a container's ``imagePullPolicy``,
  a Service's ``clusterIP``); every CRD's ``x-kubernetes-validations`` CEL rules checked
  (transition rules against the stored object). An update may keep an error the stored
  object already had (validation ratcheting), and a test can store an object as an older
  schema admitted it (``Client.create(..., unchecked=True)``);
- writes (:mod:`api_writes`): ``uid`` / ``creationTimestamp`` / ``resourceVersion`` /
  ``generation`` on create, a name from ``generateName``, ``generation`` bumped when ``spec``
  changes, a patch with a stale ``resourceVersion`` refused (409); field ownership in
  ``metadata.managedFields`` (:mod:`field_ownership`) for ``spec`` and every other
  top-level field, labels and annotations: a field an applier stops applying is removed
  unless another manager owns it, keyed lists merge item by item, an apply without
  ``force`` that would take another manager's field is a 409; a server-side apply of a
  missing object creates it; garbage collection of a deleted owner's dependents.

Tests can also make it refuse calls (:meth:`EmulatedCluster.refuse`), as an admission
webhook or an immutable field would, and see the warnings the operator was answered
(:meth:`EmulatedCluster.warnings`).

The server runs on its own event loop in a thread, so the operator (a subprocess) and
the synchronous tests both talk to it over HTTP. Known gaps: no admission webhooks, and
the built-in defaults are those of the kinds the operator writes.
"""

from __future__ import annotations

import asyncio
import threading

import aiohttp.web
import attrs
import kmock
from api_admission import OPERATOR_TOKEN, warning_header
from api_client import CLIENT_AGENT, Client, wait_for
from api_resources import OPTIONAL_RESOURCE_INFOS, RBAC_VERBS, RESOURCE_INFOS
from api_writes import Writes
from rbac_policy import RbacPolicy

__all__ = ["OPERATOR_TOKEN", "OPTIONAL_RESOURCE_INFOS", "ApiServer", "Client", "EmulatedCluster", "wait_for"]


@attrs.define(kw_only=True)
class ApiServer(Writes):
    """The emulator plus the API-server behaviour listed in the module docstring."""

    # (METHOD, path prefix) -> (HTTP status, Status message), answered instead of serving.
    refusals: dict[tuple[str, str], tuple[int, str]] = attrs.field(factory=dict, init=False)
    # The warnings the operator's requests were answered, as "METHOD PATH: warning".
    warned: list[str] = attrs.field(factory=list, init=False)
    # Every request served, in order.
    served: list[kmock.Request] = attrs.field(factory=list, init=False)

    async def _handle(self, request: kmock.Request):
        """Serve ``request``, then drop it from kmock's own log.

        NOTE: kmock finds a request's reaction by scanning its log of every request served so far,
        so with the whole log kept a request cost ~50-500 ms by the end of a test module and the
        operator fell behind the tests' waits; its log keeps only the requests in flight, and
        :attr:`served` keeps them all.
        """
        self.served.append(request)
        try:
            return await self._answer(request)
        finally:
            for index, pending in enumerate(self._requests):
                if pending is request:
                    del self._requests[index]
                    break

    async def _answer(self, request: kmock.Request):
        operator = request.headers.get("Authorization") == f"Bearer {OPERATOR_TOKEN}"
        if operator:
            fault = self.chaos.fault_for(str(request.method.value), request.url.path)
            if fault is not None:
                return fault
        refusal = self._refusal(request) or self._forbidden(request)
        if refusal is not None:
            code, message = refusal
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code}
            status["reason"] = {403: "Forbidden", 409: "Conflict", 422: "Invalid"}.get(code, "")
            return aiohttp.web.json_response(status, status=code)
        refused, warnings = await self._admit_write(request)
        if refused is not None:
            return refused
        owner_uid = self._uid_being_deleted(request)
        response = await super()._handle(request)
        if owner_uid is not None and response.status == 200:
            await self._collect_garbage(owner_uid)
        for warning in warnings:
            response.headers.add("Warning", warning_header(warning))
            if operator:
                self.warned.append(f"{request.method.value} {request.url.path}: {warning}")
        return response

    async def _admit_write(self, request: kmock.Request) -> tuple[aiohttp.web.Response | None, tuple[str, ...]]:
        """Admission and bookkeeping of a create or a patch: a refusal, or the warnings to answer with."""
        if request.resource is None or not isinstance(request.data, dict):
            return None, ()
        if request.action == kmock.action.CREATE:
            self._stamp_new(request.data)
            refused, warnings = self._admit_create(request)
            if refused is None:
                self._own_created(request)
                if request.resource.plural == "customresourcedefinitions":
                    self.schemas.learn_crd(request.data)
            return refused, warnings
        if request.action != kmock.action.UPDATE or request.name is None:
            return None, ()
        conflict = self._stale(request)
        if conflict is not None:
            return aiohttp.web.json_response(conflict, status=409), ()
        refused, warnings = self._admit_patch(request)
        refused = refused or self._apply_conflict(request)
        if refused is None:
            await self._before_patch(request)
        return refused, warnings

    def _refusal(self, request: kmock.Request) -> tuple[int, str] | None:
        method, path = str(request.method.value if request.method else ""), request.url.path
        for (refused_method, prefix), answer in list(self.refusals.items()):
            if method == refused_method and path.startswith(prefix):
                return answer
        return None


class EmulatedCluster:
    """:class:`ApiServer` on 127.0.0.1 in a background thread; ``url`` once started.

    With ``policy``, the operator's requests (those with its kubeconfig's token) are
    authorized against it and answered 403 where it does not allow them; the tests' own
    requests act as a cluster admin.
    """

    def __init__(self, policy: RbacPolicy | None = None) -> None:
        self.policy = policy
        self.url = ""
        self.api: ApiServer | None = None
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kmock-api", daemon=True)

    def start(self, timeout: float = 10) -> EmulatedCluster:
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError("the emulated API server did not start in time")
        if self._error is not None:
            raise RuntimeError("the emulated API server failed to start") from self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._started.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with ApiServer() as api, kmock.Server(api) as server:
            for resource, info in RESOURCE_INFOS.items():
                api.resources[resource] = info
            api.policy = self.policy
            self.api, self.url = api, str(server.url).rstrip("/")
            self._started.set()
            await self._stop.wait()

    def refuse(self, method: str, path_prefix: str, status: int, message: str) -> None:
        """Answer ``method`` calls under ``path_prefix`` with ``status`` and ``message`` from now on."""
        assert self.api is not None
        self.api.refusals[(method, path_prefix)] = (status, message)

    def fail_next(self, count: int, code: int, method: str | None = None, path_prefix: str = "") -> None:
        """Answer the operator's next ``count`` requests (``method`` under ``path_prefix``) with ``code``."""
        assert self.api is not None
        self.api.chaos.fail_next(count, code, method, path_prefix)

    def drop_watches(self) -> None:
        """End every open watch stream now."""
        assert self.api is not None and self._loop is not None
        asyncio.run_coroutine_threadsafe(self.api.drop_watches(), self._loop).result(timeout=10)

    def expire_versions(self) -> None:
        """Make every resourceVersion given out so far too old: watches from them get 410 Gone."""
        assert self.api is not None
        self.api.chaos.oldest_valid = int(self.api.next_version())

    def install(self, resources: dict[str, kmock.ResourceInfo]) -> None:
        """Serve more kinds from now on, as installing their CRDs would (API discovery included)."""
        assert self.api is not None
        for resource, info in resources.items():
            self.api.resources[resource] = info

    def kubeconfig(self) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "operator", "user": {"token": OPERATOR_TOKEN}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "operator"}}],
        }

    def warnings(self) -> list[str]:
        """The warnings the operator's requests were answered (unknown fields dropped), as "METHOD PATH: warning"."""
        assert self.api is not None
        return list(self.api.warned)

    def denials(self) -> list[str]:
        """The operator's requests the policy refused (403), as "METHOD PATH: message"."""
        assert self.api is not None
        return list(self.api.denials)

    def operator_requests(self) -> list[kmock.Request]:
        """Requests sent by the operator process (kopf's and our client's, not the tests')."""
        assert self.api is not None
        return [r for r in list(self.api.served) if r.headers.get("User-Agent", "") != CLIENT_AGENT]

    def operator_rbac_calls(self) -> set[tuple[str, str, str]]:
        """(group, resource[/subresource], verb) of the operator's requests, as RBAC rules name them.

        Discovery (``/api``, ``/apis/GROUP/VERSION``) is left out: it is open to every
        authenticated user.
        """
        calls = set()
        for request in self.operator_requests():
            resource = request.resource
            if resource is None or resource.plural is None:
                continue
            plural = f"{resource.plural}/{request.subresource}" if request.subresource else resource.plural
            calls.add((resource.group, plural, RBAC_VERBS[request.action.value.lower()]))
        return calls
