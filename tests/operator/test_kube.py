"""The operator's API client against the emulated API server: warnings the server answers are logged."""

from __future__ import annotations

import logging

import kubernetes
import pytest
from k8s_emulator import OPERATOR_TOKEN, EmulatedCluster

from pagedllm.operator.kube import KubeClient, api_warnings

pytestmark = pytest.mark.k8s


def test_warning_headers_are_parsed_as_the_api_server_writes_them():
    assert api_warnings(['299 - "unknown field \\"spec.foo\\""']) == ['unknown field "spec.foo"']
    # Several warnings in one header, comma-separated, and an agent name other than "-".
    assert api_warnings(['299 - "a, b", 299 kube-apiserver "c"']) == ["a, b", "c"]
    assert api_warnings(["not a warning"]) == []


@pytest.fixture()
def bare_cluster():
    emulated = EmulatedCluster().start()
    yield emulated
    emulated.stop()


@pytest.mark.asyncio
async def test_an_unknown_field_the_server_drops_is_logged(bare_cluster, caplog):
    host, token = bare_cluster.url, f"Bearer {OPERATOR_TOKEN}"
    kube = KubeClient(lambda: kubernetes.client.Configuration(host=host, api_key={"BearerToken": token}))
    labels = {"app": "x"}
    pod = {"containers": [{"name": "c", "image": "registry.example/x:1", "imagePullPolize": "Always"}]}
    manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x", "namespace": "ml"},
        "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": pod}},
    }
    try:
        with caplog.at_level(logging.WARNING, logger="pagedllm.operator.kube"):
            applied = await kube.apply(manifest)
    finally:
        await kube.close()
    # The server's default (fieldValidation=Warn): stored without the field, and said so.
    assert "imagePullPolize" not in applied["spec"]["template"]["spec"]["containers"][0]
    field = 'unknown field "spec.template.spec.containers[0].imagePullPolize"'
    assert [r.getMessage() for r in caplog.records] == [
        f"the API server warned about PATCH /apis/apps/v1/namespaces/ml/deployments/x: {field}"
    ]
    assert bare_cluster.warnings() == [f"PATCH /apis/apps/v1/namespaces/ml/deployments/x: {field}"]
