"""Status from the Deployment: phase, conditions, replicas, endpoint, observed generation."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm.operator.apply import APPLY_REFUSED
from pagedllm.operator.manifests import GENERATION_ANNOTATION, RenderConfig
from pagedllm.operator.observed import Observed, observe, problem_of
from pagedllm.operator.status import Problem, status_from

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def resource(replicas: int = 2, generation: int = 4, status: dict | None = None, **spec) -> dict:
    return {
        "metadata": {"name": "llama", "namespace": "ml", "generation": generation},
        "spec": {"model": "m", "replicas": replicas, **spec},
        "status": status or {},
    }


def deployment(ready=0, updated=0, replicas=0, generation=1, observed=1, applied=4, conditions=()) -> dict:
    return {
        "metadata": {"generation": generation, "annotations": {GENERATION_ANNOTATION: str(applied)}},
        "status": {
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "replicas": replicas,
            "observedGeneration": observed,
            "conditions": list(conditions),
        },
    }


def conditions(status: dict) -> dict:
    return {c["type"]: c for c in status["conditions"]}


@pytest.mark.parametrize(
    "dep, phase, reason",
    [
        (None, "Pending", "DeploymentMissing"),
        (deployment(), "Pending", "WaitingForReplicas"),
        (deployment(ready=1, updated=2, replicas=2), "Progressing", "RollingOut"),
        (deployment(ready=2, updated=1, replicas=3), "Progressing", "RollingOut"),
        (deployment(ready=2, updated=2, replicas=2), "Ready", "AllReplicasReady"),
        (deployment(ready=2, updated=2, replicas=2, generation=2, observed=1), "Progressing", "RollingOut"),
        (
            deployment(
                ready=2,
                updated=2,
                replicas=2,
                conditions=[
                    {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "slow"}
                ],
            ),
            "Degraded",
            "ProgressDeadlineExceeded",
        ),
        (
            deployment(
                conditions=[
                    {
                        "type": "ReplicaFailure",
                        "status": "True",
                        "reason": "FailedCreate",
                        "message": "exceeded quota: gpus",
                    }
                ]
            ),
            "Degraded",
            "FailedCreate",
        ),
    ],
)
def test_phase_follows_the_deployment(dep, phase, reason):
    status = status_from(resource(), dep, now=T0)
    assert status["phase"] == phase
    conds = conditions(status)
    assert {c["reason"] for c in conds.values()} == {reason}
    assert conds["Ready"]["status"] == ("True" if phase == "Ready" else "False")
    assert conds["Degraded"]["status"] == ("True" if phase == "Degraded" else "False")
    assert conds["Progressing"]["status"] == ("True" if phase in ("Pending", "Progressing") else "False")


def test_replicas_endpoint_and_selector():
    status = status_from(resource(port=9000), deployment(ready=1, updated=2, replicas=2), now=T0)
    assert status["replicas"] == 2 and status["readyReplicas"] == 1 and status["ready"] == "1/2"
    assert status["endpoint"] == "http://llama.ml.svc:9000"
    assert status["selector"] == "app.kubernetes.io/name=pagedllm,app.kubernetes.io/instance=llama"


def test_scaled_to_zero_is_pending_and_not_progressing():
    status = status_from(resource(replicas=0), deployment(), now=T0)
    assert status["phase"] == "Pending" and status["ready"] == "0/0"
    assert conditions(status)["Progressing"]["status"] == "False"
    assert "scale up" in conditions(status)["Ready"]["message"]


def test_observed_generation_is_the_one_the_deployment_runs():
    assert status_from(resource(generation=5), deployment(applied=4), now=T0)["observedGeneration"] == 4
    assert status_from(resource(generation=5), None, now=T0)["observedGeneration"] == 5
    problem = Problem("InvalidSpec", "spec.blockSize=12 is not allowed")
    degraded = status_from(resource(generation=5), deployment(applied=4), now=T0, problem=problem)
    assert degraded["observedGeneration"] == 5
    assert all(c["observedGeneration"] == 5 for c in degraded["conditions"])


def test_a_problem_wins_and_keeps_its_message():
    problem = Problem("InvalidSpec", "spec.blockSize=12 is not allowed: choose one of [8, 16, 32, 64, 128]")
    status = status_from(resource(), deployment(ready=2, updated=2, replicas=2), now=T0, problem=problem)
    assert status["phase"] == "Degraded"
    assert conditions(status)["Degraded"]["message"] == problem.message
    assert status["readyReplicas"] == 2  # the old pods may still serve


def test_transition_time_moves_only_when_a_status_flips():
    first = status_from(resource(), deployment(), now=T0)
    again = status_from(resource(status=first), deployment(ready=1, updated=2, replicas=2), now=T1)
    before, after = conditions(first), conditions(again)
    assert after["Ready"]["lastTransitionTime"] == T0  # still False
    assert after["Progressing"]["lastTransitionTime"] == T0  # still True
    ready = status_from(resource(status=again), deployment(ready=2, updated=2, replicas=2), now=T1)
    assert conditions(ready)["Ready"]["lastTransitionTime"] == T1
    assert before["Degraded"]["lastTransitionTime"] == conditions(ready)["Degraded"]["lastTransitionTime"] == T0


def test_odd_specs_do_not_break_status():
    status = status_from(
        {"metadata": {"name": "x", "namespace": "y"}, "spec": {"replicas": "two", "port": None}}, None, now=T0
    )
    assert status["ready"] == "0/1" and status["endpoint"] == "http://x.y.svc:8000"


CONFIG = RenderConfig(default_image="img")


def reconciled(owner: dict, dep: dict | None, pods: tuple = (), **outcome) -> dict:
    """The status a reconcile pass writes for ``owner`` having observed ``dep`` and ``pods``."""
    observed = Observed({("Deployment", "llama"): dep} if dep else {}, pods)
    return status_from(owner, dep, now=T1, problem=problem_of(owner, observed, **outcome))


def test_an_invalid_spec_is_degraded_whatever_the_deployment_says():
    error = "spec.blockSize=12 is not allowed: choose one of [8, 16, 32, 64, 128]"
    status = reconciled(resource(blockSize=12), deployment(ready=2, updated=2, replicas=2), spec_error=error)
    assert status["phase"] == "Degraded" and conditions(status)["Degraded"]["message"] == error
    assert conditions(status)["Degraded"]["reason"] == "InvalidSpec"


def test_an_apply_refusal_stands_until_an_apply_of_a_newer_generation_or_a_successful_one():
    refused = status_from(resource(generation=4), None, now=T0, problem=Problem(APPLY_REFUSED, "Deployment: nope"))
    healthy = deployment(ready=2, updated=2, replicas=2, applied=3)
    assert reconciled(resource(generation=4, status=refused), healthy)["phase"] == "Degraded"
    assert reconciled(resource(generation=5, status=refused), healthy)["phase"] == "Ready"
    assert reconciled(resource(generation=4, status=refused), healthy, applied=True)["phase"] == "Ready"
    again = Problem(APPLY_REFUSED, "Deployment: still no")
    status = reconciled(resource(generation=4, status=refused), healthy, refused=again, applied=True)
    assert conditions(status)["Degraded"]["message"] == "Deployment: still no"


def test_server_exit_reads_the_last_termination_message():
    from pagedllm.operator.status import server_exit

    pod = {
        "metadata": {"name": "p"},
        "status": {
            "containerStatuses": [
                {"name": "server", "lastState": {"terminated": {"exitCode": 2, "message": "bad flag\n"}}}
            ]
        },
    }
    problem = server_exit(pod, "server")
    assert problem is not None and problem.reason == "ServerExited"
    assert problem.message == "pod p: the server exited with code 2: bad flag"
    assert server_exit(pod, "sidecar") is None
    ready = {**pod, "status": {**pod["status"], "conditions": [{"type": "Ready", "status": "True"}]}}
    assert server_exit(ready, "server") is None
    clean = {"status": {"containerStatuses": [{"name": "server", "lastState": {"terminated": {"exitCode": 0}}}]}}
    assert server_exit(clean, "server") is None


def crashed_pod(name: str = "llama-1", code: int = 2, message: str = "bad flag") -> dict:
    terminated = {"exitCode": code, "message": message}
    return {
        "metadata": {"name": name},
        "status": {"containerStatuses": [{"name": "server", "lastState": {"terminated": terminated}}]},
    }


def test_a_server_exit_shows_while_the_pods_show_it():
    restarting = deployment(ready=1, updated=2, replicas=2)  # its status moved as the pod restarted
    status = reconciled(resource(generation=4), restarting, (crashed_pod(),))
    assert status["phase"] == "Degraded" and status["readyReplicas"] == 1
    assert conditions(status)["Degraded"]["message"] == "pod llama-1: the server exited with code 2: bad flag"
    clean = {"metadata": {"name": "llama-2"}, "status": {}}
    assert reconciled(resource(generation=4), restarting, (clean,))["phase"] == "Progressing"


class Reader:
    """Children by kind, pods for a list; records what was asked."""

    def __init__(self, dep: dict | None, pods: list):
        self.dep, self.pods, self.asked = dep, pods, []

    async def get(self, kind, namespace, name, api_version=None):
        self.asked.append(("get", kind, name))
        return self.dep if kind == "Deployment" else None

    async def request(self, method, path, *, query=None):
        self.asked.append(("list", path, dict(query or [])["labelSelector"]))
        return {"items": self.pods}


def test_observe_lists_the_pods_only_while_a_desired_replica_is_not_ready():
    owner = resource(replicas=2)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "llama"}}
    reader = Reader(deployment(ready=1, updated=2, replicas=2), [crashed_pod()])
    observed = asyncio.run(observe(reader, owner, [service]))
    assert observed.pods == (crashed_pod(),) and observed.get("Service", "llama") is None
    assert reader.asked == [
        ("get", "Service", "llama"),
        ("get", "Deployment", "llama"),
        (
            "list",
            "/api/v1/namespaces/ml/pods",
            "app.kubernetes.io/instance=llama,app.kubernetes.io/managed-by=pagedllm-operator",
        ),
    ]
    ready = Reader(deployment(ready=2, updated=2, replicas=2), [crashed_pod()])
    assert asyncio.run(observe(ready, owner, [])).pods == () and [a[0] for a in ready.asked] == ["get"]
