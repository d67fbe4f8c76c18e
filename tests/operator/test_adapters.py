"""spec.adapters: a ConfigMap the pods read at start (the server through $PAGEDLLM_LORA_MODULES, parsed
by the real CLI; fetch-model through $PAGEDLLM_ADAPTER_DOWNLOADS), a pod template that does not
change with the list, and sources that cannot be served refused."""

from __future__ import annotations

import pytest
from resource_factories import CONFIG, body, pod, server
from test_server_command import run_as_container

from pagedllm.operator import adapters as operator_adapters
from pagedllm.operator.manifests import render
from pagedllm.operator.spec import PagedLLMSpec, SpecError
from pagedllm.server.entrypoints import download, serve
from pagedllm.server.entrypoints.openai import serving_lora
from pagedllm.server.entrypoints.openai.serving_lora import parse_lora_modules

PVC_SOURCE = {"type": "pvc", "pvc": {"claimName": "weights", "path": "llama"}}
HUB_ADAPTERS = [{"name": "sql", "source": "org/sql-lora"}, {"name": "chat", "source": "org/chat-lora"}]


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def config_map_ref(key: str) -> dict:
    return {"configMapKeyRef": {"name": "llama-adapters", "key": key, "optional": True}}


def test_the_variables_are_the_ones_the_server_reads():
    assert operator_adapters.LORA_MODULES_ENV == serve.LORA_MODULES_ENV
    assert operator_adapters.RUNTIME_LORA_ENV == serving_lora.RUNTIME_LORA_ENV
    assert operator_adapters.DOWNLOADS_ENV == download.ADAPTERS_ENV


def test_hub_adapters_reach_the_server_and_the_download_through_the_config_map(monkeypatch):
    manifests = render(body(model="org/model", adapters=HUB_ADAPTERS), CONFIG)
    data = manifests.adapters["data"]
    assert manifests.adapters["metadata"]["name"] == "llama-adapters"
    assert data == {
        "lora-modules": "sql=/models/adapters/sql chat=/models/adapters/chat",
        "downloads": "org/sql-lora /models/adapters/sql org/chat-lora /models/adapters/chat",
    }
    container = server(manifests)
    args = run_as_container(container["args"])
    assert args.enable_lora is True and args.lora_modules is None
    assert env_of(container)["PAGEDLLM_LORA_MODULES"] == config_map_ref("lora-modules")
    assert env_of(container)["PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    monkeypatch.setenv("PAGEDLLM_LORA_MODULES", data["lora-modules"])
    assert serve.settings_from_args(args).lora_modules == {
        "sql": "/models/adapters/sql",
        "chat": "/models/adapters/chat",
    }
    fetch = pod(manifests)["initContainers"][0]
    assert fetch["command"][fetch["command"].index("download") + 1 :] == ["hf://org/model", "/models/org/model"]
    assert env_of(fetch)["PAGEDLLM_ADAPTER_DOWNLOADS"] == config_map_ref("downloads")
    monkeypatch.setenv("PAGEDLLM_ADAPTER_DOWNLOADS", data["downloads"])
    assert download.adapters_from_env() == [
        ("org/sql-lora", "/models/adapters/sql"),
        ("org/chat-lora", "/models/adapters/chat"),
    ]


@pytest.mark.parametrize(
    "before, after",
    [
        ([], HUB_ADAPTERS),
        (HUB_ADAPTERS, HUB_ADAPTERS[:1]),
        (HUB_ADAPTERS[:1], [{"name": "sql", "source": "org/sql-lora-v2"}]),
    ],
)
def test_the_pod_template_does_not_change_with_the_adapters(before, after):
    def template(adapters):
        return render(body(model="org/model", enableLora=True, adapters=adapters), CONFIG).deployment["spec"][
            "template"
        ]

    assert template(before) == template(after)


def test_pvc_adapters_read_the_model_claim_mounted_whole_and_read_only():
    adapters = [{"name": "sql", "source": "pvc:loras/sql"}]
    manifests = render(body(model="llama", modelSource=PVC_SOURCE, adapters=adapters), CONFIG)
    mounts = {m["mountPath"]: m for m in server(manifests)["volumeMounts"]}
    assert mounts["/adapters"] == {"name": "model", "mountPath": "/adapters", "readOnly": True}
    assert manifests.adapters["data"] == {"lora-modules": "sql=/adapters/loras/sql", "downloads": ""}
    assert parse_lora_modules(manifests.adapters["data"]["lora-modules"].split()) == {"sql": "/adapters/loras/sql"}
    assert "initContainers" not in pod(manifests)


def test_the_model_cache_job_gets_the_hub_adapters_as_arguments():
    manifests = render(body(model="org/model", adapters=HUB_ADAPTERS, modelCache={"size": "20Gi"}), CONFIG)
    command = manifests.job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-6:] == [
        "--adapter",
        "org/sql-lora",
        "/models/adapters/sql",
        "--adapter",
        "org/chat-lora",
        "/models/adapters/chat",
    ]


def test_no_adapters_render_no_lora_flags():
    manifests = render(body(model="org/model"), CONFIG)
    args = server(manifests)["args"]
    assert "--enable-lora" not in args and "--lora-modules" not in args
    assert manifests.adapters is None and "PAGEDLLM_LORA_MODULES" not in env_of(server(manifests))


@pytest.mark.parametrize(
    "spec,message",
    [
        ({"adapters": [{"name": "a", "source": "pvc:x"}]}, "needs spec.modelSource.type pvc"),
        ({"model": "/in/image", "adapters": [{"name": "a", "source": "org/a"}]}, "must come from the Hugging Face"),
        ({"adapters": [{"name": "a", "source": "not a repo"}]}, r"adapters\[0\].source='not a repo' is not allowed"),
        ({"modelSource": PVC_SOURCE, "adapters": [{"name": "a", "source": "pvc:../x"}]}, "without '..'"),
        ({"adapters": [{"name": "a", "source": "o/a"}, {"name": "a", "source": "o/b"}]}, r"adapters\[1\].name='a'"),
        ({"extraArgs": ["--lora-modules", "x=/y"]}, "rendered from spec.adapters"),
    ],
)
def test_adapters_that_cannot_be_served_are_refused(spec, message):
    with pytest.raises(SpecError, match=message):
        PagedLLMSpec.from_dict({"model": "org/model", **spec})
        render(body(**{"model": "org/model", **spec}), CONFIG)
