"""The server pods' HTTP API as the operator calls it (aiohttp, which kopf brings): the adapters routes.

The server's errors are OpenAI-shaped (``{"error": {"message": ...}}``); :class:`PodApiError`
carries that message, so a resource's condition says what the server said.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from pagedllm.operator.adapter_sync import PodApiError

TIMEOUT_SECONDS = 30  # NOTE: a load reads the adapter's weights from disk before it answers


class HttpPodApi:
    """:class:`~pagedllm.operator.adapter_sync.PodApi` over HTTP; ``api_key`` for a server that asks one."""

    def __init__(self, session: aiohttp.ClientSession, api_key: str | None = None) -> None:
        self.session = session
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def models(self, base: str) -> list[dict]:
        found = await self._call("GET", f"{base}/v1/models")
        return list((found or {}).get("data", [])) if isinstance(found, dict) else []

    async def load(self, base: str, name: str, path: str) -> None:
        await self._call("POST", f"{base}/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def unload(self, base: str, name: str) -> None:
        await self._call("POST", f"{base}/v1/unload_lora_adapter", {"lora_name": name})

    async def _call(self, method: str, url: str, body: dict | None = None) -> Any:
        timeout = aiohttp.ClientTimeout(total=TIMEOUT_SECONDS)
        try:
            async with self.session.request(method, url, json=body, headers=self.headers, timeout=timeout) as answer:
                text = await answer.text()
                if answer.status >= 400:
                    raise PodApiError(f"HTTP {answer.status}: {_message(answer, text)}")
                return await answer.json(content_type=None) if answer.content_type == "application/json" else text
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise PodApiError(f"{url} did not answer: {exc or type(exc).__name__}") from exc


def _message(answer: aiohttp.ClientResponse, text: str) -> str:
    import json

    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return text.strip()[:500] or answer.reason or ""
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return text.strip()[:500]
