"""kopf's session, made by the operator's login handler: the API server's warnings to kopf's writes are logged."""

from __future__ import annotations

import logging

import kopf
import pytest
from k8s_emulator import OPERATOR_TOKEN, EmulatedCluster

from pagedllm.operator.kopf_session import session_login

pytestmark = pytest.mark.k8s


@pytest.fixture()
def bare_cluster():
    emulated = EmulatedCluster().start()
    yield emulated
    emulated.stop()


def deployment(pod: dict) -> dict:
    labels = {"app": "x"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x", "namespace": "ml"},
        "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": pod}},
    }


@pytest.mark.asyncio
async def test_a_warning_to_a_request_on_kopfs_session_is_logged(bare_cluster, caplog):
    info = kopf.ConnectionInfo(server=bare_cluster.url, scheme="Bearer", token=OPERATOR_TOKEN, default_namespace="ml")
    login = session_login(info)
    assert isinstance(login, kopf.AiohttpSession)
    assert (login.server, login.default_namespace) == (bare_cluster.url, "ml")
    pod = {"containers": [{"name": "c", "image": "registry.example/x:1", "imagePullPolize": "Always"}]}
    path = "/apis/apps/v1/namespaces/ml/deployments"
    try:
        with caplog.at_level(logging.WARNING, logger="pagedllm.operator.kopf_session"):
            async with login.aiohttp_session.post(bare_cluster.url + path, json=deployment(pod)) as response:
                assert response.status in (200, 201), await response.text()
            async with login.aiohttp_session.get(f"{bare_cluster.url}{path}/x") as response:
                assert response.status == 200
    finally:
        await login.aiohttp_session.close()
    field = 'unknown field "spec.template.spec.containers[0].imagePullPolize"'
    assert [r.getMessage() for r in caplog.records] == [f"the API server warned about POST {path}: {field}"]
