"""A small asynchronous Kubernetes API client for the handlers.

kopf watches and patches the ``PagedLLM`` resources itself; the children (Deployment,
Service, claim) need plain get / server-side apply / status patch calls, which this
client makes over ``aiohttp`` (already a kopf dependency) with the same credentials kopf
uses: the in-cluster service account, else the kubeconfig (``kopf.login_with_*``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import kopf

FIELD_MANAGER = "pagedllm-operator"
APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"

# kind -> (API prefix, plural) of what the operator manages.
RESOURCES: Mapping[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "Pod": ("/api/v1", "pods"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "PagedLLM": ("/apis/pagedllm.dev/v1alpha1", "pagedllms"),
}


class ApiError(Exception):
    """A non-2xx answer from the API server, with Kubernetes' Status message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message

    @property
    def retriable(self) -> bool:
        """Worth retrying as is: conflicts, throttling, server-side trouble, auth races."""
        return self.status in (401, 403, 409, 429) or self.status >= 500


def object_path(kind: str, namespace: str, name: str, subresource: str | None = None) -> str:
    prefix, plural = RESOURCES[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}/{name}"
    return f"{path}/{subresource}" if subresource else path


def default_login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """The operator's own credentials, found the way kopf's built-in login finds them."""
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError("no credentials: neither an in-cluster service account nor a kubeconfig was found")
    return info


class KubeClient:
    """Get, server-side apply and merge-patch objects; one ``aiohttp`` session."""

    def __init__(self, login: Callable[[], kopf.ConnectionInfo], logger: logging.Logger | None = None):
        self._login = login
        self._session: aiohttp.ClientSession | None = None
        self._server = ""
        self._logger = logger or logging.getLogger(__name__)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _connect(self) -> aiohttp.ClientSession:
        info = self._login()
        self._server = str(info.server).rstrip("/")
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
            headers={**info.as_http_headers(), "User-Agent": FIELD_MANAGER},
            timeout=aiohttp.ClientTimeout(total=30),
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict | None = None,
        content_type: str = "application/json",
    ) -> dict | None:
        """One API call; ``None`` for 404 on GET, :class:`ApiError` for any other failure."""
        for attempt in (1, 2):
            if self._session is None:
                self._session = self._connect()
            data = json.dumps(body) if body is not None else None
            headers = {"Content-Type": content_type} if data is not None else {}
            async with self._session.request(
                method, self._server + path, data=data, params=params, headers=headers
            ) as response:
                text = await response.text()
                payload = json.loads(text) if text.strip() else None
                if response.status == 401 and attempt == 1:
                    # NOTE: service-account tokens rotate; log in again once, then give up.
                    await self.close()
                    continue
                if response.status == 404 and method == "GET":
                    return None
                if response.status >= 400:
                    message = payload.get("message", "") if isinstance(payload, dict) else str(payload)
                    raise ApiError(response.status, message or response.reason or "")
                return payload
        raise AssertionError("unreachable")  # pragma: no cover

    async def get(self, kind: str, namespace: str, name: str) -> dict | None:
        return await self.request("GET", object_path(kind, namespace, name))

    async def apply(self, manifest: Mapping[str, Any]) -> dict:
        """Server-side apply: create the object, or converge the fields this operator owns."""
        meta = manifest["metadata"]
        path = object_path(manifest["kind"], meta["namespace"], meta["name"])
        params = {"fieldManager": FIELD_MANAGER, "force": "true"}
        result = await self.request("PATCH", path, body=manifest, params=params, content_type=APPLY_PATCH)
        assert result is not None
        return result

    async def patch_status(self, kind: str, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        await self.request(
            "PATCH", object_path(kind, namespace, name, "status"), body={"status": status}, content_type=MERGE_PATCH
        )
