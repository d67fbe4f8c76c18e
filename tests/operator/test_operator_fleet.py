"""The operator beyond one Deployment: disruption budgets, phase events, drift repair, servers that exit."""

from __future__ import annotations

import time

import pytest
from emulated_scenario import KIND, condition, pagedllm

pytestmark = pytest.mark.k8s


def test_a_server_that_refuses_to_start_shows_why_on_the_resource(scenario):
    """A refusal only the model reveals (heads not divisible by the TP size) reaches the status."""
    scenario.api.create(pagedllm(scenario.ns, tensorParallelSize=2))
    dep = scenario.wait_deployment()
    refusal = (
        "pagedllm serve: error: the engine failed to start: --tensor-parallel-size=2 is not allowed: "
        "a divisor of the model's number of attention heads (25)"
    )
    scenario.api.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "llama-abc12",
                "namespace": scenario.ns,
                "labels": dep["spec"]["template"]["metadata"]["labels"],
            },
            "spec": {"containers": [{"name": "server", "image": "img"}]},
            "status": {
                "containerStatuses": [
                    {
                        "name": "server",
                        "ready": False,
                        "restartCount": 3,
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {"terminated": {"exitCode": 2, "reason": "Error", "message": refusal}},
                    }
                ]
            },
        }
    )
    obj = scenario.wait_status(lambda s, o: s.get("phase") == "Degraded", "Degraded")
    degraded = condition(obj, "Degraded")
    assert degraded["reason"] == "ServerExited" and "--tensor-parallel-size=2 is not allowed" in degraded["message"]
    assert "llama-abc12" in degraded["message"] and "code 2" in degraded["message"]


def test_phase_changes_are_events_and_two_replicas_get_a_disruption_budget(scenario):
    scenario.api.create(pagedllm(scenario.ns, replicas=2))
    dep = scenario.wait_deployment()
    budget = scenario.wait(lambda: scenario.get("PodDisruptionBudget"), "the PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1 and budget["metadata"]["ownerReferences"][0]["kind"] == KIND
    assert budget["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    scenario.api.patch(
        "Deployment",
        scenario.ns,
        "llama",
        {
            "status": {
                "observedGeneration": dep["metadata"]["generation"],
                "replicas": 2,
                "updatedReplicas": 2,
                "readyReplicas": 2,
                "availableReplicas": 2,
            }
        },
        sub="status",
    )
    scenario.wait_status(lambda s, o: s.get("phase") == "Ready", "Ready")

    def phase_events():
        return [e["message"] for e in scenario.events() if e.get("reason") == "PhaseChanged"]

    scenario.wait(lambda: any(m.startswith("Pending -> Ready") for m in phase_events()), "a Pending -> Ready event")
    assert any(m.startswith("new -> Pending") for m in phase_events())


def test_a_hand_edited_deployment_is_set_back(scenario, cluster):
    scenario.api.create(pagedllm(scenario.ns, replicas=2))
    scenario.wait_deployment()
    scenario.api.patch("Deployment", scenario.ns, "llama", {"spec": {"replicas": 5}})
    scenario.wait(lambda: (scenario.get("Deployment") or {}).get("spec", {}).get("replicas") == 2, "replicas set back")
    scenario.wait(lambda: [e for e in scenario.events() if e.get("reason") == "DriftRepaired"], "a DriftRepaired event")
    before = len(cluster.operator_requests())
    time.sleep(1.5)
    assert len(cluster.operator_requests()) - before < 10  # settled: no apply loop on its own updates


def test_one_replica_gets_no_disruption_budget(scenario):
    scenario.api.create(pagedllm(scenario.ns))
    scenario.wait_deployment()
    scenario.wait_status(lambda s, o: s.get("phase") == "Pending", "Pending")
    assert scenario.get("PodDisruptionBudget") is None
