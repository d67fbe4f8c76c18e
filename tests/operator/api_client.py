"""The tests' synchronous HTTP client of the emulated API server, and a poll helper.

The client acts as kubectl does: its writes ask for ``fieldValidation=Strict`` (an unknown
field is a 422, not a warning) unless the path names another level.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from api_admission import UNCHECKED_HEADER
from api_resources import STEM

from pagedllm.operator.kube import RESOURCES

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
        status, answer, _ = self.send(method, path, body, content_type, headers)
        return status, answer

    def send(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/merge-patch+json",
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any, list[str]]:
        """Status, decoded body and the ``Warning`` headers of the answer."""
        data = json.dumps(body).encode() if body is not None else None
        if method in ("POST", "PUT", "PATCH") and "fieldValidation=" not in path:
            path += ("&" if "?" in path else "?") + "fieldValidation=Strict"
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
                answer = json.loads(response.read() or b"null")
                return response.status, answer, response.headers.get_all("Warning") or []
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null"), exc.headers.get_all("Warning") or []

    def path(self, kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        prefix, plural = {**RESOURCES, **STEM}[kind]
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
