"""A Kubernetes API for the operator tests: kmock's ``KubernetesEmulator`` over real HTTP.

kmock 0.8 stores objects as given and merges patches. The operator relies on a few
things a real API server does and kmock does not, which :class:`ApiServer` adds:

- ``metadata.uid`` / ``creationTimestamp`` / ``resourceVersion`` / ``generation`` on
  create (owner references need the owner's uid), and a name from ``generateName``;
- ``generation`` bumped when ``spec`` changes (through the object or its ``/scale``);
- a patch that carries a stale ``metadata.resourceVersion`` is refused (409 Conflict);
- server-side apply (``application/apply-patch+yaml``) of a missing object creates it, and
  every write of ``spec`` keeps its field managers' ownership in ``metadata.managedFields``:
  a field an applier stops applying is removed unless another manager owns it, and lists
  with keys (containers, env, ports, volumes, ... by the schemas' list-map keys) merge item
  by item (:mod:`field_ownership`);
- every write is checked against its kind's schema, the Kubernetes OpenAPI schemas of
  ``kubernetes-validate`` or the CRD's, and refused with 422 Invalid (unknown fields, wrong
  types, missing required fields: ``fieldValidation=Strict``); PagedLLMs are also pruned
  (``fieldValidation=Ignore|Warn``), defaulted and checked against the CRD's CEL rules
  (:mod:`api_schemas`). An update may keep an error the stored object already had
  (validation ratcheting), and a test can store an object as an older schema admitted it
  (``Client.create(..., unchecked=True)``);
- RBAC: with a policy (:mod:`rbac_policy`, the chart's rendered roles), every request of
  the operator (its kubeconfig's token) is authorized by verb, group, resource, namespace
  and name, and answered 403 Forbidden where the roles do not allow it; an apply that
  creates needs ``create`` too. Refusals are kept (:meth:`EmulatedCluster.denials`);
- garbage collection: deleting an object deletes the objects whose owner references name
  its uid (and theirs, in turn), as the API server's collector does in the background;
- trouble on demand (:mod:`api_chaos`): 409/429/5xx answers to the operator's next
  requests, watch streams cut, 410 Gone on a watch from an expired resourceVersion.

Tests can also make it refuse calls (:meth:`EmulatedCluster.refuse`), as an admission
webhook or an immutable field would.

The server runs on its own event loop in a thread, so the operator (a subprocess) and
the synchronous tests both talk to it over HTTP. Known gaps: no admission beyond the
schemas, no defaulting of built-in kinds, no ``fieldValidation=Warn`` warning header,
KEDA's ScaledObject, the InferencePool and the PodMonitor are checked against the
project's own JSON Schemas (no package registry ships their CRDs' YAML), and ownership
is tracked for ``spec`` only.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp.web
import attrs
import field_ownership
import kmock
from api_admission import OPERATOR_TOKEN, UNCHECKED_HEADER, Admission
from kmock._internal import dicts as kmock_dicts
from rbac_policy import RbacPolicy

from pagedllm.operator.kube import APPLY_PATCH, RESOURCES

RESOURCE_INFOS = {
    "pagedllm.dev/v1alpha1/pagedllms": kmock.ResourceInfo(
        kind="PagedLLM",
        singular="pagedllm",
        namespaced=True,
        shortnames={"pllm"},
        subresources={"status", "scale"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "apps/v1/deployments": kmock.ResourceInfo(
        kind="Deployment",
        singular="deployment",
        namespaced=True,
        subresources={"status", "scale"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "v1/services": kmock.ResourceInfo(
        kind="Service",
        singular="service",
        namespaced=True,
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "policy/v1/poddisruptionbudgets": kmock.ResourceInfo(
        kind="PodDisruptionBudget",
        singular="poddisruptionbudget",
        namespaced=True,
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "autoscaling/v2/horizontalpodautoscalers": kmock.ResourceInfo(
        kind="HorizontalPodAutoscaler",
        singular="horizontalpodautoscaler",
        namespaced=True,
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "v1/pods": kmock.ResourceInfo(
        kind="Pod",
        singular="pod",
        namespaced=True,
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "batch/v1/jobs": kmock.ResourceInfo(
        kind="Job",
        singular="job",
        namespaced=True,
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "discovery.k8s.io/v1/endpointslices": kmock.ResourceInfo(
        kind="EndpointSlice",
        singular="endpointslice",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "v1/serviceaccounts": kmock.ResourceInfo(
        kind="ServiceAccount",
        singular="serviceaccount",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "v1/secrets": kmock.ResourceInfo(
        kind="Secret",
        singular="secret",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "v1/configmaps": kmock.ResourceInfo(
        kind="ConfigMap",
        singular="configmap",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "rbac.authorization.k8s.io/v1/roles": kmock.ResourceInfo(
        kind="Role",
        singular="role",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "rbac.authorization.k8s.io/v1/rolebindings": kmock.ResourceInfo(
        kind="RoleBinding",
        singular="rolebinding",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "networking.k8s.io/v1/networkpolicies": kmock.ResourceInfo(
        kind="NetworkPolicy",
        singular="networkpolicy",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "coordination.k8s.io/v1/leases": kmock.ResourceInfo(
        kind="Lease",
        singular="lease",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "v1/persistentvolumeclaims": kmock.ResourceInfo(
        kind="PersistentVolumeClaim",
        singular="persistentvolumeclaim",
        namespaced=True,
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    # NOTE: kopf waits to discover namespaces before it starts any watch, even cluster-wide
    # (where it never lists them; listing them from kmock fails).
    "v1/namespaces": kmock.ResourceInfo(
        kind="Namespace", singular="namespace", namespaced=False, verbs={"get", "list", "watch"}
    ),
    "v1/events": kmock.ResourceInfo(
        kind="Event", singular="event", namespaced=True, verbs={"get", "list", "watch", "create", "patch"}
    ),
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        kind="CustomResourceDefinition",
        singular="customresourcedefinition",
        namespaced=False,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
}

# Kinds of optional CRDs (KEDA, Gateway API Inference Extension, Prometheus Operator, LeaderWorkerSet): served
# only by clusters that install them (:meth:`EmulatedCluster.install`).
_OPTIONAL_KINDS = (
    ("keda.sh/v1alpha1", "scaledobjects", "ScaledObject"),
    ("inference.networking.k8s.io/v1", "inferencepools", "InferencePool"),
    ("monitoring.coreos.com/v1", "podmonitors", "PodMonitor"),
    ("leaderworkerset.x-k8s.io/v1", "leaderworkersets", "LeaderWorkerSet"),
)
OPTIONAL_RESOURCE_INFOS = {
    f"{group_version}/{plural}": kmock.ResourceInfo(
        kind=kind,
        singular=plural[:-1],
        namespaced=True,
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    )
    for group_version, plural, kind in _OPTIONAL_KINDS
}

# Where the tests' client finds the kinds the operator names only through discovery.
_STEM = {
    "Event": ("/api/v1", "events"),
    "Job": ("/apis/batch/v1", "jobs"),
    "EndpointSlice": ("/apis/discovery.k8s.io/v1", "endpointslices"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Secret": ("/api/v1", "secrets"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    **{kind: (f"/apis/{gv}", plural) for gv, plural, kind in _OPTIONAL_KINDS},
}


@attrs.define(kw_only=True)
class ApiServer(Admission):
    """The emulator plus the API-server behaviour listed in the module docstring."""

    # (METHOD, path prefix) -> (HTTP status, Status message), answered instead of serving.
    refusals: dict[tuple[str, str], tuple[int, str]] = attrs.field(factory=dict, init=False)

    async def _handle(self, request: kmock.Request):
        if request.headers.get("Authorization") == f"Bearer {OPERATOR_TOKEN}":
            fault = self.chaos.fault_for(str(request.method.value), request.url.path)
            if fault is not None:
                return fault
        refusal = self._refusal(request) or self._forbidden(request)
        if refusal is not None:
            code, message = refusal
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code}
            status["reason"] = {403: "Forbidden", 409: "Conflict", 422: "Invalid"}.get(code, "")
            return aiohttp.web.json_response(status, status=code)
        if request.resource is not None and isinstance(request.data, dict):
            if request.action == kmock.action.CREATE:
                self._stamp_new(request.data)
                invalid = self._invalid(request, request.data)
                if invalid is not None:
                    return invalid
                self._default(request, request.data)
                if request.resource.plural == "customresourcedefinitions":
                    self.schemas.learn_crd(request.data)
            elif request.action == kmock.action.UPDATE and request.name is not None:
                conflict = self._stale(request)
                if conflict is not None:
                    return aiohttp.web.json_response(conflict, status=409)
                invalid = self._invalid(request, self._prospective(request))
                if invalid is not None:
                    return invalid
                await self._before_patch(request)
                self._default_patch(request)
        owner_uid = self._uid_being_deleted(request)
        response = await super()._handle(request)
        if owner_uid is not None and response.status == 200:
            await self._collect_garbage(owner_uid)
        return response

    def _uid_being_deleted(self, request: kmock.Request) -> str | None:
        if request.action != kmock.action.DELETE or request.resource is None or request.name is None:
            return None
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].raw.get("metadata", {}).get("uid")

    async def _collect_garbage(self, owner_uid: str) -> None:
        async with self._lock:
            dependents = [
                (key, obj.raw)
                for key, obj in list(self.objects.items())
                if not obj.deleted
                and any(ref.get("uid") == owner_uid for ref in obj.raw.get("metadata", {}).get("ownerReferences") or [])
            ]
            for key, raw in dependents:
                self.objects[key].delete()
                await self._buses[key[0]].put({"type": "DELETED", "object": raw})
        for _, raw in dependents:
            await self._collect_garbage(raw["metadata"].get("uid"))

    def _refusal(self, request: kmock.Request) -> tuple[int, str] | None:
        method, path = str(request.method.value if request.method else ""), request.url.path
        for (refused_method, prefix), answer in list(self.refusals.items()):
            if method == refused_method and path.startswith(prefix):
                return answer
        return None

    def _stale(self, request: kmock.Request) -> dict | None:
        """A 409 Status when the patch carries a resourceVersion that is no longer the object's."""
        given = (request.data.get("metadata") or {}).get("resourceVersion")
        key = (request.resource, request.namespace, request.name)
        if given is None or key not in self.objects or self.objects[key].deleted:
            return None
        current = self.objects[key].raw.get("metadata", {}).get("resourceVersion")
        if str(given) == str(current):
            return None
        message = f"Operation cannot be fulfilled on {request.name}: the object has been modified"
        return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": 409}

    def _stamp_new(self, data: dict) -> None:
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta.setdefault("uid", str(uuid.uuid4()))
        now = datetime.datetime.now(datetime.timezone.utc)
        meta.setdefault("creationTimestamp", now.strftime("%Y-%m-%dT%H:%M:%SZ"))
        meta["generation"] = 1
        meta["resourceVersion"] = self.next_version()

    async def _before_patch(self, request: kmock.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        exists = key in self.objects and not self.objects[key].deleted
        if not exists:
            content_type = {k.lower(): v for k, v in request.headers.items()}.get("content-type", "")
            if content_type.startswith(APPLY_PATCH) and request.subresource is None:
                await self._create_by_apply(key, request.data, request.url.query.get("fieldManager") or "kubectl")
            return
        old = self.objects[key].raw
        kept = self._record_owners(request, key)
        meta = request.data.setdefault("metadata", {})
        meta["resourceVersion"] = self.next_version()
        if request.subresource in (None, "scale"):
            new = kmock_dicts.patch_dict(copy.deepcopy(kept), request.data)
            if new.get("spec") != old.get("spec"):
                meta["generation"] = old.get("metadata", {}).get("generation", 1) + 1

    def _record_owners(self, request: kmock.Request, key: tuple) -> dict:
        """Field ownership of a write of ``spec`` (or ``/scale``); the stored object, less what the write dropped."""
        old = copy.deepcopy(self.objects[key].raw)
        spec = request.data.get("spec")
        if request.subresource not in (None, "scale") or not isinstance(spec, dict):
            return old
        applied = request.subresource is None and self._content_type(request).startswith(APPLY_PATCH)
        manager = request.url.query.get("fieldManager") or ("kubectl" if applied else "kubectl-edit")
        keys = self.schemas.list_keys(old.get("apiVersion", ""), old.get("kind", ""))
        entries, removed = field_ownership.record_write(old, spec, manager, applied, old.get("apiVersion", ""), keys)
        new = field_ownership.without(old, removed)
        new.setdefault("metadata", {})["managedFields"] = entries
        self.objects[key] = new
        if applied:  # keyed lists merge with the items other managers own
            request.data["spec"] = field_ownership.merge_applied(new.get("spec") or {}, spec, keys)
        return new

    async def _create_by_apply(self, key: tuple, data: dict, manager: str) -> None:
        self._stamp_new(data)
        if isinstance(data.get("spec"), dict):
            api_version = data.get("apiVersion", "")
            keys = self.schemas.list_keys(api_version, data.get("kind", ""))
            entries, _ = field_ownership.record_write(None, data["spec"], manager, True, api_version, keys)
            data["metadata"]["managedFields"] = entries
        async with self._lock:
            self.objects[key] = copy.deepcopy(data)
            await self._buses[key[0]].put({"type": "ADDED", "object": self.objects[key].raw})


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

    def denials(self) -> list[str]:
        """The operator's requests the policy refused (403), as "METHOD PATH: message"."""
        assert self.api is not None
        return list(self.api.denials)

    def operator_requests(self) -> list[kmock.Request]:
        """Requests sent by the operator process (kopf's and our client's, not the tests')."""
        assert self.api is not None
        return [r for r in list(self.api._requests) if r.headers.get("User-Agent", "") != CLIENT_AGENT]

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


# kmock's action names -> the RBAC verbs they need.
RBAC_VERBS = {
    "list": "list",
    "watch": "watch",
    "fetch": "get",
    "create": "create",
    "update": "patch",
    "delete": "delete",
}


CLIENT_AGENT = "pagedllm-tests"


class Client:
    """Synchronous HTTP calls from the tests to the emulated API."""

    def __init__(self, url: str, token: str | None = None):
        self.url, self.token = url, token

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/merge-patch+json",
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": content_type, "User-Agent": CLIENT_AGENT}
            | ({"Authorization": f"Bearer {self.token}"} if self.token else {})
            | (headers or {}),
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def path(self, kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        prefix, plural = {**RESOURCES, **_STEM}[kind]
        path = f"{prefix}/namespaces/{namespace}/{plural}"
        if name is None:
            return path
        return f"{path}/{name}/{sub}" if sub else f"{path}/{name}"

    def create(self, obj: dict, *, unchecked: bool = False) -> dict:
        """Create ``obj``; ``unchecked``: as an older schema admitted it (the emulator does not validate it)."""
        meta = obj["metadata"]
        headers = {UNCHECKED_HEADER: "1"} if unchecked else {}
        path = self.path(obj["kind"], meta["namespace"])
        status, body = self.request("POST", path, obj, "application/json", headers)
        assert status in (200, 201), (status, body)
        return body

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        status, body = self.request("GET", self.path(kind, namespace, name))
        if status == 404:
            return None
        assert status == 200, (status, body)
        return body

    def patch(self, kind: str, namespace: str, name: str, body: dict, sub: str | None = None) -> dict:
        status, result = self.request("PATCH", self.path(kind, namespace, name, sub), body)
        assert status == 200, (status, result)
        return result

    def delete(self, kind: str, namespace: str, name: str) -> None:
        status, result = self.request("DELETE", self.path(kind, namespace, name))
        assert status == 200, (status, result)

    def list(self, kind: str, namespace: str) -> list[dict]:
        status, body = self.request("GET", self.path(kind, namespace))
        assert status == 200, (status, body)
        return body["items"]


def wait_for(
    probe: Callable[[], Any],
    *,
    timeout: float = 15,
    what: str = "condition",
    on_timeout: Callable[[], str] = lambda: "",
) -> Any:
    """Poll ``probe`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what}; last value: {value!r}\n{on_timeout()}"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
