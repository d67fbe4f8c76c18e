"""Kubernetes API calls for the handlers, through the official ``kubernetes`` client.

kopf watches and patches the ``PagedLLM`` resources itself; the children (Deployment,
Service, claim, and whatever else a resource renders to) need get / server-side apply /
status patch calls and API discovery, which :class:`KubeClient` makes with the
``kubernetes`` package's ``ApiClient``. Its calls are synchronous, so each runs in a
worker thread (``asyncio.to_thread``) and the handlers' event loop never blocks.

Credentials are found the standard way: the in-cluster service account (its token
re-read as it rotates), else the kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf
import kubernetes
import urllib3

FIELD_MANAGER = "pagedllm-operator"
APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"
REQUEST_TIMEOUT_SECONDS = 30
# How long an answer of API discovery is trusted: a CRD installed later (KEDA, the
# Prometheus Operator) is noticed within this time, without a discovery call per apply.
DISCOVERY_TTL_SECONDS = 60.0

logger = logging.getLogger(__name__)
# One warning of a ``Warning`` header (RFC 7234): code, agent, quoted text; the API server sends
# code 299 for unknown fields it dropped and deprecated APIs.
_WARNING = re.compile(r'\d{3} \S+ "((?:[^"\\]|\\.)*)"')

# kind -> (API prefix, plural) of the kinds the handlers name without an apiVersion
# (``get`` / ``patch_status``); any other kind is found through API discovery.
RESOURCES: Mapping[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "Pod": ("/api/v1", "pods"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "Secret": ("/api/v1", "secrets"),
    "PagedLLM": ("/apis/pagedllm.dev/v1alpha1", "pagedllms"),
    "HorizontalPodAutoscaler": ("/apis/autoscaling/v2", "horizontalpodautoscalers"),
    "EndpointSlice": ("/apis/discovery.k8s.io/v1", "endpointslices"),
}


class ApiError(Exception):
    """A non-2xx answer from the API server, with Kubernetes' Status message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message

    @property
    def retriable(self) -> bool:
        """Worth retrying as is: conflicts, throttling, server-side trouble.

        NOTE: 401/403 (no permission), 422 (an invalid or immutable field) and the other
        4xx answers do not heal by asking again; the handlers report them as ``Degraded``.
        """
        return self.status in (409, 429) or self.status >= 500


class ApiUnreachable(ApiError):
    """No answer at all (connection refused, reset, timed out): always worth a retry."""

    def __init__(self, message: str):
        super().__init__(503, f"the API server could not be reached: {message}")

    @property
    def retriable(self) -> bool:
        return True


def api_prefix(api_version: str) -> str:
    """``v1`` -> ``/api/v1``; ``apps/v1`` -> ``/apis/apps/v1``."""
    return "/api/v1" if api_version == "v1" else f"/apis/{api_version}"


@dataclass(frozen=True)
class ApiResource:
    """Where the API serves one kind."""

    prefix: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None, name: str, subresource: str | None = None) -> str:
        scope = f"/namespaces/{namespace}" if self.namespaced else ""
        path = f"{self.prefix}{scope}/{self.plural}/{name}"
        return f"{path}/{subresource}" if subresource else path


def object_path(kind: str, namespace: str, name: str, subresource: str | None = None) -> str:
    prefix, plural = RESOURCES[kind]
    return ApiResource(prefix, plural).path(namespace, name, subresource)


def collection_path(kind: str, namespace: str) -> str:
    """Where the objects of ``kind`` in ``namespace`` are listed."""
    prefix, plural = RESOURCES[kind]
    return f"{prefix}/namespaces/{namespace}/{plural}"


def default_login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """kopf's credentials, found by the same ``kubernetes`` loaders as :func:`load_configuration`."""
    info = kopf.login_via_client(settings=settings, logger=logging.getLogger(__name__))
    if info is None:
        raise kopf.LoginError("no credentials: neither an in-cluster service account nor a kubeconfig was found")
    return info


def load_configuration() -> kubernetes.client.Configuration:
    """The in-cluster service account if there is one, else the kubeconfig."""
    config = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=config)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(client_configuration=config)
    return config


def api_warnings(values: list[str]) -> list[str]:
    """The texts of ``Warning`` headers (``299 - "unknown field \\"spec.foo\\""`` -> ``unknown field "spec.foo"``)."""
    found = []
    for value in values:
        for match in _WARNING.finditer(value):
            found.append(json.loads(f'"{match.group(1)}"'))
    return found


def _status_message(data: bytes | None, reason: str | None) -> str:
    """The ``message`` of Kubernetes' Status answer, else whatever the body says."""
    text = (data or b"").decode("utf-8", errors="replace").strip()
    try:
        payload = json.loads(text) if text else None
    except ValueError:
        payload = text
    message = payload.get("message", "") if isinstance(payload, dict) else str(payload or "")
    return message or reason or ""


class KubeClient:
    """Get, server-side apply and merge-patch objects of any kind; answer what the cluster serves."""

    def __init__(
        self,
        configure: Callable[[], kubernetes.client.Configuration] = load_configuration,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._configure = configure
        self._clock = clock
        self._api: kubernetes.client.ApiClient | None = None
        # api_version -> (when asked, kind -> where it is served); {} when the group is not served.
        self._discovery: dict[str, tuple[float, dict[str, ApiResource]]] = {}

    async def close(self) -> None:
        if self._api is not None:
            api, self._api = self._api, None
            await asyncio.to_thread(api.close)

    def _client(self) -> kubernetes.client.ApiClient:
        if self._api is None:
            try:
                config = self._configure()
            except kubernetes.config.ConfigException as exc:
                raise ApiError(401, f"no credentials: no in-cluster service account and no kubeconfig ({exc})") from exc
            self._api = kubernetes.client.ApiClient(config)
            self._api.user_agent = FIELD_MANAGER
        return self._api

    def _send(self, method: str, path: str, body: Any, query: list, content_type: str) -> Any:
        """One blocking call; the decoded JSON answer, or :class:`ApiError`."""
        client = self._client()
        headers = {"Accept": "application/json", "Content-Type": content_type}
        request = client.param_serialize(
            method, path, query_params=query, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        try:
            response = client.call_api(*request, _request_timeout=REQUEST_TIMEOUT_SECONDS)
            response.read()
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiUnreachable(repr(exc)) from exc
        except kubernetes.client.ApiException as exc:  # status 0: the request never got an answer
            raise ApiUnreachable(str(exc.reason)) from exc
        # NOTE: the API server drops an unknown field the operator writes (fieldValidation=Warn, its
        # default) and says so only here: a rendering bug, or a field this cluster's version lacks.
        for text in api_warnings(response.headers.getlist("Warning")):
            logger.warning("the API server warned about %s %s: %s", method, path, text)
        if not 200 <= response.status <= 299:
            raise ApiError(response.status, _status_message(response.data, response.reason))
        return json.loads(response.data) if response.data and response.data.strip() else None

    async def request(
        self, method: str, path: str, *, body: Any = None, query: list | None = None, content_type: str = ""
    ) -> Any:
        """One API call off the event loop; credentials are loaded again once after a 401."""
        args = (method, path, body, query or [], content_type or "application/json")
        try:
            return await asyncio.to_thread(self._send, *args)
        except ApiError as exc:
            if exc.status != 401:
                raise
        # NOTE: tokens rotate (bound service-account tokens, exec plugins): log in again once, then give up.
        await self.close()
        return await asyncio.to_thread(self._send, *args)

    async def resource(self, api_version: str, kind: str) -> ApiResource | None:
        """Where ``kind`` of ``api_version`` is served, ``None`` if it is not (discovery, cached)."""
        prefix = api_prefix(api_version)
        known = RESOURCES.get(kind)
        if known is not None and known[0] == prefix:
            return ApiResource(*known)
        asked = self._discovery.get(api_version)
        if asked is None or self._clock() - asked[0] > DISCOVERY_TTL_SECONDS:
            asked = (self._clock(), await self._discover(prefix))
            self._discovery[api_version] = asked
        return asked[1].get(kind)

    async def _discover(self, prefix: str) -> dict[str, ApiResource]:
        try:
            listing = await self.request("GET", prefix)
        except ApiError as exc:
            if exc.status == 404:
                return {}  # the group or version is not served at all
            raise
        return {
            item["kind"]: ApiResource(prefix, item["name"], bool(item.get("namespaced", True)))
            for item in (listing or {}).get("resources", [])
            if "/" not in item.get("name", "/")  # subresources (deployments/scale) are not kinds
        }

    async def served(self, api_version: str, kind: str) -> bool:
        """Whether the cluster serves ``kind`` in ``api_version`` (e.g. a CRD that is installed)."""
        return await self.resource(api_version, kind) is not None

    async def _locate(self, api_version: str, kind: str) -> ApiResource:
        found = await self.resource(api_version, kind)
        if found is None:
            raise ApiError(404, f"the cluster does not serve {kind} in {api_version} (is its CRD installed?)")
        return found

    async def get(self, kind: str, namespace: str, name: str, api_version: str | None = None) -> dict | None:
        """The object, ``None`` if it does not exist; ``api_version`` for kinds not in :data:`RESOURCES`."""
        if api_version is None:
            path = object_path(kind, namespace, name)
        else:
            where = await self.resource(api_version, kind)
            if where is None:
                return None  # a kind the cluster does not serve has no objects
            path = where.path(namespace, name)
        try:
            return await self.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def apply(self, manifest: Mapping[str, Any], field_manager: str = FIELD_MANAGER) -> dict:
        """Server-side apply of any kind: create the object, or converge the fields this operator owns.

        ``force``: the operator is the one owner of what it renders, so a conflicting
        manager (a hand edit with ``kubectl apply``) loses those fields back to it.
        """
        meta = manifest["metadata"]
        where = await self._locate(manifest["apiVersion"], manifest["kind"])
        query = [("fieldManager", field_manager), ("force", "true")]
        path = where.path(meta.get("namespace"), meta["name"])
        result = await self.request("PATCH", path, body=dict(manifest), query=query, content_type=APPLY_PATCH)
        if not isinstance(result, dict):
            raise ApiError(500, f"server-side apply of {manifest['kind']} {meta['name']} answered {result!r}")
        return result

    async def delete(self, kind: str, namespace: str, name: str, api_version: str, uid: str) -> None:
        """Delete the object if it is still the one with ``uid`` (not a namesake created since)."""
        where = await self._locate(api_version, kind)
        options = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}}
        query = [("propagationPolicy", "Background")]
        await self.request("DELETE", where.path(namespace, name), body=options, query=query)

    async def patch_status(self, kind: str, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        path = object_path(kind, namespace, name, "status")
        await self.request("PATCH", path, body={"status": dict(status)}, content_type=MERGE_PATCH)
