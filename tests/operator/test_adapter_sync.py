"""Run-time adapters: a pass loads what the spec adds and unloads what it drops, on every ready server pod,
through the pod's HTTP API (a local fake of `pagedllm serve`'s routes); the report is status and condition."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from fake_pod_api import FakePodApi

from pagedllm.operator.adapter_sync import AdapterReport, ready_server_pods, sync_adapters, with_adapters
from pagedllm.operator.adapters import Adapter
from pagedllm.operator.pod_api import HttpPodApi

SQL = Adapter("sql", "org/sql-lora")
CHAT = Adapter("chat", "pvc:loras/chat")


def pod(name: str, ready: bool = True, worker: str | None = None, ip: str = "127.0.0.1") -> dict:
    labels = {"leaderworkerset.sigs.k8s.io/worker-index": worker} if worker is not None else {}
    return {
        "metadata": {"name": name, "labels": labels},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


@pytest.fixture()
def fake():
    server = FakePodApi(api_key="k")
    yield server
    server.close()


def sync(pods, adapters, fake, key="k") -> AdapterReport:
    async def run():
        async with aiohttp.ClientSession() as session:
            return await sync_adapters(tuple(pods), tuple(adapters), fake.port, HttpPodApi(session, key))

    return asyncio.run(run())


def test_adapters_added_are_loaded_and_removed_ones_unloaded(fake):
    report = sync([pod("p0")], [SQL, CHAT], fake)
    assert fake.loaded == {"sql": "/models/adapters/sql", "chat": "/adapters/loras/chat"}
    assert report.condition()[:2] == ("True", "AdaptersLoaded")
    assert report.status((SQL, CHAT))[0] == {
        "name": "sql",
        "loaded": "1/1",
        "pods": [{"name": "p0", "state": "Loaded"}],
    }

    fake.calls.clear()
    sync([pod("p0")], [CHAT], fake)
    assert fake.loaded == {"chat": "/adapters/loras/chat"}
    assert fake.calls == [("/v1/unload_lora_adapter", {"lora_name": "sql"})]  # chat was left alone


def test_an_adapter_whose_source_changed_is_loaded_again(fake):
    sync([pod("p0")], [SQL], fake)
    moved = Adapter("sql", "pvc:loras/sql-v2")
    sync([pod("p0")], [moved], fake)
    assert fake.loaded == {"sql": "/adapters/loras/sql-v2"}


def test_a_failed_load_is_a_condition_with_the_servers_message(fake):
    fake.refuse["/models/adapters/sql"] = "adapter rank 128 is above --max-lora-rank 16"
    report = sync([pod("p0")], [SQL, CHAT], fake)
    state, reason, message = report.condition()
    assert (state, reason) == ("False", "AdapterLoadFailed")
    assert message == "adapter sql on pod p0: HTTP 400: adapter rank 128 is above --max-lora-rank 16"
    pods = report.status((SQL, CHAT))[0]["pods"]
    assert pods == [
        {"name": "p0", "state": "Failed", "message": "HTTP 400: adapter rank 128 is above --max-lora-rank 16"}
    ]
    assert fake.loaded == {"chat": "/adapters/loras/chat"}


def test_a_pod_that_does_not_answer_is_reported_not_raised(fake):
    report = sync([pod("p0"), pod("gone", ip="127.0.0.2")], [SQL], fake)
    rows = {row["name"]: row for row in report.status((SQL,))[0]["pods"]}
    assert rows["p0"]["state"] == "Loaded" and rows["gone"]["state"] == "Failed"
    assert "did not answer" in rows["gone"]["message"]


def test_the_api_key_is_sent(fake):
    report = sync([pod("p0")], [SQL], fake, key="wrong")
    assert "HTTP 401: invalid or missing API key" in report.condition()[2]


def test_only_ready_leaders_and_single_pods_are_called():
    pods = [pod("a"), pod("b", ready=False), pod("c", worker="0"), pod("d", worker="1")]
    pods.append({**pod("e"), "metadata": {"name": "e", "deletionTimestamp": "x"}})
    assert [p["metadata"]["name"] for p in ready_server_pods(tuple(pods))] == ["a", "c"]


def test_no_ready_pod_is_unknown_and_lora_off_drops_the_status():
    report = AdapterReport()
    assert report.condition()[:2] == ("Unknown", "NoReadyPod")
    status = with_adapters({"conditions": [{"type": "Ready", "status": "True"}]}, (SQL,), report, "now")
    assert [c["type"] for c in status["conditions"]] == ["Ready", "AdaptersReady"]
    assert status["adapters"] == [{"name": "sql", "loaded": "0/0", "pods": []}]
    off = with_adapters(status, (), None, "later")
    assert off["adapters"] is None and [c["type"] for c in off["conditions"]] == ["Ready"]
