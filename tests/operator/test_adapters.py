"""spec.adapters: rendered into --enable-lora --lora-modules (parsed by the real CLI), the fetch-model
download and read-only mounts of the model's claim; sources that cannot be served are refused."""

from __future__ import annotations

import pytest
from resource_factories import CONFIG, body, pod, server
from test_server_command import run_as_container

from pagedllm.operator.manifests import render
from pagedllm.operator.spec import PagedLLMSpec, SpecError
from pagedllm.server.entrypoints.openai.serving_lora import parse_lora_modules

PVC_SOURCE = {"type": "pvc", "pvc": {"claimName": "weights", "path": "llama"}}


def test_hub_adapters_download_with_the_model_and_reach_the_server():
    adapters = [{"name": "sql", "source": "org/sql-lora"}, {"name": "chat", "source": "org/chat-lora"}]
    manifests = render(body(model="org/model", adapters=adapters), CONFIG)
    args = run_as_container(server(manifests)["args"])
    assert args.enable_lora is True
    assert parse_lora_modules(args.lora_modules) == {
        "sql": "/models/adapters/sql",
        "chat": "/models/adapters/chat",
    }
    fetch = pod(manifests)["initContainers"][0]["command"]
    assert fetch[fetch.index("download") + 1 :] == [
        "hf://org/model",
        "/models/org/model",
        "--adapter",
        "org/sql-lora",
        "/models/adapters/sql",
        "--adapter",
        "org/chat-lora",
        "/models/adapters/chat",
    ]


def test_pvc_adapters_mount_the_model_claim_read_only():
    adapters = [{"name": "sql", "source": "pvc:loras/sql"}]
    manifests = render(body(model="llama", modelSource=PVC_SOURCE, adapters=adapters), CONFIG)
    mounts = {m["mountPath"]: m for m in server(manifests)["volumeMounts"]}
    assert mounts["/adapters/sql"] == {
        "name": "model",
        "mountPath": "/adapters/sql",
        "subPath": "loras/sql",
        "readOnly": True,
    }
    assert parse_lora_modules(run_as_container(server(manifests)["args"]).lora_modules) == {"sql": "/adapters/sql"}
    assert "initContainers" not in pod(manifests)


def test_no_adapters_render_no_lora_flags():
    args = server(render(body(model="org/model"), CONFIG))["args"]
    assert "--enable-lora" not in args and "--lora-modules" not in args


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
