"""Adapters added to and removed from a running model, by a real operator process against the emulator:
the pod template stays as it was, and the ready pod (a local fake of `pagedllm serve`'s adapter routes)
is loaded and unloaded through its API, with status per adapter and pod."""

from __future__ import annotations

import pytest
from emulated_scenario import KIND, condition, pagedllm
from fake_pod_api import FakePodApi

pytestmark = pytest.mark.k8s

SQL = {"name": "sql", "source": "org/sql-lora"}
CHAT = {"name": "chat", "source": "org/chat-lora"}


@pytest.fixture()
def fake():
    server = FakePodApi()
    yield server
    server.close()


def ready_pod(scenario, labels: dict) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "llama-abc12", "namespace": scenario.ns, "labels": labels},
        "spec": {"containers": [{"name": "server", "image": "img"}]},
        "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def test_adapters_change_on_running_pods_without_a_rollout(scenario, fake):
    scenario.api.create(pagedllm(scenario.ns, model="org/model", port=fake.port, adapters=[SQL]))
    dep = scenario.wait_deployment()
    template = dep["spec"]["template"]
    assert scenario.get("ConfigMap", "llama-adapters")["data"]["lora-modules"] == "sql=/models/adapters/sql"
    scenario.api.create(ready_pod(scenario, template["metadata"]["labels"]))
    scenario.wait(lambda: fake.loaded == {"sql": "/models/adapters/sql"}, "sql loaded on the pod")
    obj = scenario.wait_status(lambda s, o: condition(o, "AdaptersReady").get("status") == "True", "AdaptersReady")
    assert obj["status"]["adapters"] == [
        {"name": "sql", "loaded": "1/1", "pods": [{"name": "llama-abc12", "state": "Loaded"}]}
    ]

    scenario.api.patch(KIND, scenario.ns, "llama", {"spec": {"adapters": [CHAT]}})
    scenario.wait(lambda: fake.loaded == {"chat": "/models/adapters/chat"}, "chat loaded, sql unloaded")
    scenario.wait_status(lambda s, o: [a["name"] for a in s.get("adapters") or []] == ["chat"], "chat in the status")
    assert scenario.get("ConfigMap", "llama-adapters")["data"]["lora-modules"] == "chat=/models/adapters/chat"
    assert scenario.get("Deployment")["spec"]["template"] == template  # no pod restarts


def test_a_failed_load_is_a_condition_with_the_servers_message(scenario, fake):
    fake.refuse["/models/adapters/sql"] = "the adapter's rank 128 is above --max-lora-rank 16"
    scenario.api.create(pagedllm(scenario.ns, model="org/model", port=fake.port, adapters=[SQL]))
    dep = scenario.wait_deployment()
    scenario.api.create(ready_pod(scenario, dep["spec"]["template"]["metadata"]["labels"]))
    obj = scenario.wait_status(lambda s, o: condition(o, "AdaptersReady").get("status") == "False", "load failed")
    cond = condition(obj, "AdaptersReady")
    assert cond["reason"] == "AdapterLoadFailed"
    assert cond["message"] == (
        "adapter sql on pod llama-abc12: HTTP 400: the adapter's rank 128 is above --max-lora-rank 16"
    )


def test_the_api_key_of_the_pods_is_sent(scenario):
    import base64

    fake = FakePodApi(api_key="s3cret")
    try:
        secret = {"api-key": base64.b64encode(b"s3cret").decode()}
        scenario.api.create(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "llama-key", "namespace": scenario.ns},
                "data": secret,
            }
        )
        spec = {"model": "org/model", "port": fake.port, "adapters": [SQL], "apiKeySecret": {"name": "llama-key"}}
        scenario.api.create(pagedllm(scenario.ns, **spec))
        dep = scenario.wait_deployment()
        scenario.api.create(ready_pod(scenario, dep["spec"]["template"]["metadata"]["labels"]))
        scenario.wait(lambda: fake.loaded == {"sql": "/models/adapters/sql"}, "sql loaded with the key")
    finally:
        fake.close()
