"""The operator converges through what a real API server throws at it: conflicts, throttling, server
errors, watch streams cut, and 410 Gone on a watch from an expired resourceVersion.

The faults are answered to the operator's requests only (:mod:`api_chaos`); each test checks they
were served, so a test that stopped reaching the operator would fail rather than pass vacuously.
"""

from __future__ import annotations

import pytest
from emulated_scenario import KIND, flag_value, pagedllm, server_container

pytestmark = pytest.mark.k8s


def served(cluster, code: int) -> list[str]:
    return [s for s in cluster.api.chaos.served if s.startswith(f"{code} ")]


def test_conflicts_throttling_and_server_errors_are_retried(scenario, cluster):
    before = {code: len(served(cluster, code)) for code in (409, 429, 503)}
    # One fault per child of the first reconcile pass, which goes on past a transient error: one retry.
    ns = f"/namespaces/{scenario.ns}/"
    cluster.fail_next(1, 409, "PATCH", f"/apis/apps/v1{ns}deployments/")
    cluster.fail_next(1, 429, "PATCH", f"/api/v1{ns}services/")
    cluster.fail_next(1, 503, "GET", f"/apis/networking.k8s.io/v1{ns}networkpolicies/")
    scenario.api.create(pagedllm(scenario.ns))
    scenario.wait_deployment()
    scenario.wait(lambda: scenario.get("Service"), "the Service")
    scenario.wait_status(
        lambda s, o: s.get("phase") == "Pending" and s.get("observedGeneration") == 1, "status Pending", timeout=45
    )
    assert cluster.api.chaos.pending() == 0
    assert all(len(served(cluster, code)) > before[code] for code in before), cluster.api.chaos.served


def watch_requests(cluster) -> list:
    return [r for r in cluster.operator_requests() if r.action is not None and r.action.value == "WATCH"]


def block_size(scenario, value: int):
    scenario.api.patch(KIND, scenario.ns, "llama", {"spec": {"blockSize": value}})
    scenario.wait_deployment(
        lambda d: flag_value(server_container(d)["args"], "--block-size") == str(value), f"--block-size {value}"
    )


def test_watch_streams_cut_and_expired_versions_are_followed_again(scenario, cluster):
    scenario.api.create(pagedllm(scenario.ns))
    scenario.wait_deployment()

    watches = len(watch_requests(cluster))
    cluster.drop_watches()
    scenario.wait(lambda: len(watch_requests(cluster)) > watches, "the operator watching again")
    block_size(scenario, 32)

    gone = len(served(cluster, 410))
    cluster.expire_versions()
    cluster.drop_watches()
    scenario.wait(lambda: len(served(cluster, 410)) > gone, "a watch answered 410 Gone")
    block_size(scenario, 64)
    scenario.wait_status(lambda s, o: s.get("observedGeneration") == 3, "observedGeneration 3")
