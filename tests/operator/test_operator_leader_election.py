"""Two operator replicas with --leader-elect against the emulated cluster: one reconciles, the other takes over."""

from __future__ import annotations

import contextlib
import urllib.request

import pytest
from emulated_scenario import pagedllm
from k8s_emulator import Client, wait_for
from operator_process import running_operator
from prometheus_client.parser import text_string_to_metric_families

from tests.support import free_port

pytestmark = pytest.mark.k8s

NS = "pagedllm-system"  # the release namespace, where the chart grants the Lease
LEASE = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/pagedllm-operator"


def elected(identity: str, metrics_port: int) -> tuple[str, ...]:
    lease = ("--leader-elect", "--leader-election-namespace", NS, "--leader-election-id", identity)
    # NOTE: a lease far longer than the waits below: the take-over must come from the hand-over.
    return (*lease, "--lease-duration", "60", "--metrics-port", str(metrics_port))


def metrics(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def holder(api: Client) -> str | None:
    status, lease = api.request("GET", LEASE)
    return lease["spec"]["holderIdentity"] if status == 200 else None


def reconciled(operator, name: str) -> bool:
    return f"to {NS}/{name}" in operator.log_path.read_text(errors="replace")


def test_only_the_lease_holder_reconciles_and_the_standby_takes_over(cluster, tmp_path):
    api, port_a, port_b = Client(cluster.url), free_port(), free_port()
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(running_operator(cluster, tmp_path / "a", extra_args=elected("operator-a", port_a)))
        wait_for(lambda: holder(api) == "operator-a", what="operator-a leading", on_timeout=first.log)
        second = running_operator(cluster, tmp_path / "b", extra_args=elected("operator-b", port_b))
        standby = stack.enter_context(second)  # its liveness answers while it stands by
        api.create(pagedllm(NS, "one"))
        wait_for(lambda: api.get("Deployment", NS, "one"), what="one's Deployment", on_timeout=first.log)
        wait_for(lambda: reconciled(first, "one"), what="the leader's reconcile", on_timeout=first.log)
        assert not reconciled(standby, "one") and holder(api) == "operator-a"
        assert "waiting to lead" in standby.log_path.read_text()
        # NOTE: the pass is counted when its handler returns, a moment after the log line above.
        counted = ("pagedllm_operator_reconciles_total", (("result", "ok"), ("trigger", "spec")))
        wait_for(lambda: metrics(port_a).get(counted, 0) >= 1, what="the leader's pass counted", on_timeout=first.log)
        leading, waiting = metrics(port_a), metrics(port_b)
        assert leading[("pagedllm_operator_leader", ())] == 1 and waiting[("pagedllm_operator_leader", ())] == 0
        assert leading[("pagedllm_operator_managed_resources", (("phase", "Pending"),))] == 1
        assert not any(name == "pagedllm_operator_reconciles_total" for name, _ in waiting)

        first.proc.terminate()  # SIGTERM (a rollout, a drain): the leader stops and hands the Lease over
        first.proc.wait(timeout=30)
        assert first.proc.returncode == 0, first.log()
        wait_for(lambda: holder(api) == "operator-b", timeout=20, what="operator-b leading", on_timeout=standby.log)
        api.create(pagedllm(NS, "two"))
        wait_for(lambda: api.get("Deployment", NS, "two"), what="two's Deployment", on_timeout=standby.log)
        wait_for(lambda: reconciled(standby, "two"), what="the new leader's reconcile", on_timeout=standby.log)
        assert standby.alive()
        log = standby.log_path.read_text(errors="replace")
        assert "Traceback" not in log and "[ERROR" not in log, standby.log(100)


def test_chart_rbac_grants_the_lease_calls(cluster, helm_template):
    from helm_tools import rules_of

    docs = helm_template("--set", "clusterWide=true")
    granted = set().union(*(rules_of(d) for d in docs if d["kind"] in ("ClusterRole", "Role")))
    used = cluster.operator_rbac_calls()
    assert {("coordination.k8s.io", "leases", "patch"), ("coordination.k8s.io", "leases", "get")} <= used
    assert used - granted == set(), f"calls the chart's RBAC does not allow: {sorted(used - granted)}"
