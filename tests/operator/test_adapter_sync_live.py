"""The operator's adapter calls against a real server (the OpenAI app of `pagedllm serve`, a tiny random
LLaMA on CPU, LoRA on and run-time updates allowed, as the operator renders its pods): adapters are
loaded, unloaded and reported through the server's own routes and error messages."""

from __future__ import annotations

import asyncio
import urllib.parse

import aiohttp
import pytest

from pagedllm.operator.adapter_sync import sync_adapters
from pagedllm.operator.adapters import Adapter
from pagedllm.operator.pod_api import HttpPodApi
from pagedllm.server.demo import save_tiny_llama
from pagedllm.server.entrypoints.openai.settings import ServerSettings
from tests.server.api_factories import CHAT_TEMPLATE, MODEL_NAME, live_server
from tests.server.lora_factories import save_random_adapter

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("live-adapters")
    base = save_tiny_llama(str(root / "base"), seed=4, initializer_range=0.2, **SHAPE)
    paths = {name: save_random_adapter(base, str(root / name), seed=seed) for name, seed in (("sql", 1), ("chat", 2))}
    settings = ServerSettings(
        served_model_names=[MODEL_NAME], chat_template=CHAT_TEMPLATE, allow_runtime_lora_updating=True
    )
    with live_server(base, settings, enable_lora=True, max_loras=2) as live:
        yield live, paths, root


def sync(live, adapters):
    port = urllib.parse.urlsplit(live.url).port
    pod = {
        "metadata": {"name": "p0"},
        "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }

    async def run():
        async with aiohttp.ClientSession() as session:
            return await sync_adapters((pod,), tuple(adapters), port, HttpPodApi(session))

    return asyncio.run(run())


def served_adapters(live) -> dict:
    import httpx

    cards = httpx.get(f"{live.url}/v1/models", timeout=30).json()["data"]
    return {c["id"]: c["root"] for c in cards if c.get("parent")}


def adapter(name: str, path: str) -> Adapter:
    """A ``pvc:`` adapter read at ``path``: the claim root, /adapters in a pod, is / here (patched per test)."""
    return Adapter(name, "pvc:" + path)


def test_adapters_load_and_unload_on_a_real_server(served, monkeypatch):
    live, paths, _ = served
    monkeypatch.setattr("pagedllm.operator.adapters.PVC_ADAPTERS_DIR", "")
    sql, chat = adapter("sql", paths["sql"]), adapter("chat", paths["chat"])
    report = sync(live, [sql, chat])
    assert report.condition()[:2] == ("True", "AdaptersLoaded"), report.condition()
    assert served_adapters(live) == {"sql": sql.path, "chat": chat.path}

    report = sync(live, [chat])
    assert served_adapters(live) == {"chat": chat.path} and report.condition()[0] == "True"


def test_a_refused_load_carries_the_servers_message(served, monkeypatch):
    live, _, root = served
    monkeypatch.setattr("pagedllm.operator.adapters.PVC_ADAPTERS_DIR", "")
    missing = adapter("gone", str(root / "no-such-adapter"))
    report = sync(live, [missing])
    state, reason, message = report.condition()
    assert (state, reason) == ("False", "AdapterLoadFailed")
    assert message.startswith("adapter gone on pod p0: HTTP 400: "), message
    assert "no-such-adapter" in message
