"""The operator process against kmock's KubernetesEmulator over real HTTP.

One operator (`pagedllm operator --all-namespaces --standalone`) serves the whole module;
each test works in its own namespace. Waits are polls with a deadline, never sleeps.
"""

from __future__ import annotations

import urllib.request

import pytest
from emulated_scenario import KIND, condition, flag_value, pagedllm, server_container
from helm_tools import rules_of

pytestmark = pytest.mark.k8s


def test_liveness_endpoint_answers(operator):
    with urllib.request.urlopen(operator.liveness, timeout=5) as response:
        assert response.status == 200


def test_create_renders_owned_deployment_and_service_and_reports_status(scenario):
    created = scenario.api.create(pagedllm(scenario.ns, blockSize=16, hfTokenSecret={"name": "hf"}))
    uid = created["metadata"]["uid"]

    deployment = scenario.wait_deployment()
    service = scenario.wait(lambda: scenario.get("Service"), "the Service")
    for obj in (deployment, service):
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "pagedllm.dev/v1alpha1",
            "kind": KIND,
            "name": "llama",
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "pagedllm-operator"
    container = server_container(deployment)
    assert container["image"] == "registry.example/pagedllm:test"  # the operator's --default-image
    assert flag_value(container["args"], "--block-size") == "16"
    assert service["spec"]["ports"][0]["port"] == 8000

    obj = scenario.wait_status(
        lambda s, o: s.get("phase") == "Pending" and s.get("observedGeneration") == 1, "status Pending"
    )
    status = obj["status"]
    assert status["endpoint"] == f"http://llama.{scenario.ns}.svc:8000"
    assert status["ready"] == "0/1" and status["readyReplicas"] == 0
    assert status["selector"] == "app.kubernetes.io/name=pagedllm,app.kubernetes.io/instance=llama"
    assert condition(obj, "Ready")["status"] == "False"
    assert condition(obj, "Progressing")["status"] == "True"
    assert condition(obj, "Degraded")["status"] == "False"

    applied = scenario.wait(lambda: [e for e in scenario.events() if e.get("reason") == "Applied"], "an event")
    assert applied[0]["involvedObject"]["uid"] == uid


def test_spec_changes_patch_the_deployment(scenario):
    scenario.api.create(pagedllm(scenario.ns))
    scenario.wait_deployment()

    scenario.api.patch(KIND, scenario.ns, "llama", {"spec": {"blockSize": 32}})
    scenario.wait_deployment(
        lambda d: flag_value(server_container(d)["args"], "--block-size") == "32", "--block-size 32"
    )

    scenario.api.patch(KIND, scenario.ns, "llama", {"spec": {"tensorParallelSize": 2}})
    dep = scenario.wait_deployment(
        lambda d: server_container(d)["resources"]["limits"].get("nvidia.com/gpu") == 2, "2 GPUs"
    )
    container = server_container(dep)
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert flag_value(container["args"], "--tensor-parallel-size") == "2"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert dep["metadata"]["annotations"]["pagedllm.dev/generation"] == "3"
    scenario.wait_status(lambda s, o: s.get("observedGeneration") == 3, "observedGeneration 3")


def test_scale_subresource_changes_replicas(scenario):
    scenario.api.create(pagedllm(scenario.ns))
    scenario.wait_deployment()

    scenario.api.patch(KIND, scenario.ns, "llama", {"spec": {"replicas": 3}}, sub="scale")
    scenario.wait_deployment(lambda d: d["spec"]["replicas"] == 3, "3 replicas")
    scenario.wait_status(lambda s, o: s.get("ready") == "0/3", "status.ready 0/3")


def test_deployment_deleted_by_hand_comes_back(scenario):
    scenario.api.create(pagedllm(scenario.ns))
    first = scenario.wait_deployment()

    scenario.api.delete("Deployment", scenario.ns, "llama")
    again = scenario.wait_deployment(
        lambda d: d["metadata"]["uid"] != first["metadata"]["uid"], "a recreated Deployment"
    )
    assert server_container(again)["args"] == server_container(first)["args"]
    scenario.wait(lambda: [e for e in scenario.events() if e.get("reason") == "Recreating"], "a Recreating event")


def test_service_deleted_by_hand_comes_back(scenario):
    scenario.api.create(pagedllm(scenario.ns))
    first = scenario.wait(lambda: scenario.get("Service"), "the Service")

    scenario.api.delete("Service", scenario.ns, "llama")
    scenario.wait(
        lambda: (s := scenario.get("Service")) and s["metadata"]["uid"] != first["metadata"]["uid"],
        "a recreated Service",
    )


def test_status_follows_deployment_readiness(scenario):
    scenario.api.create(pagedllm(scenario.ns, replicas=2))
    dep = scenario.wait_deployment()
    generation = dep["metadata"]["generation"]

    def report(**status):
        scenario.api.patch("Deployment", scenario.ns, "llama", {"status": status}, sub="status")

    report(observedGeneration=generation, replicas=2, updatedReplicas=2, readyReplicas=1)
    obj = scenario.wait_status(lambda s, o: s.get("phase") == "Progressing", "Progressing")
    assert obj["status"]["ready"] == "1/2" and condition(obj, "Ready")["status"] == "False"

    report(readyReplicas=2, availableReplicas=2)
    obj = scenario.wait_status(lambda s, o: s.get("phase") == "Ready", "Ready")
    assert obj["status"]["readyReplicas"] == 2 and obj["status"]["replicas"] == 2
    assert condition(obj, "Ready")["status"] == "True"
    assert condition(obj, "Progressing")["status"] == "False"

    report(
        readyReplicas=0,
        conditions=[
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": 'ReplicaSet "llama-1" has timed out progressing.',
            }
        ],
    )
    obj = scenario.wait_status(lambda s, o: s.get("phase") == "Degraded", "Degraded")
    degraded = condition(obj, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "ProgressDeadlineExceeded"
    assert "timed out" in degraded["message"]


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


def test_one_replica_gets_no_disruption_budget(scenario):
    scenario.api.create(pagedllm(scenario.ns))
    scenario.wait_deployment()
    scenario.wait_status(lambda s, o: s.get("phase") == "Pending", "Pending")
    assert scenario.get("PodDisruptionBudget") is None


def test_invalid_spec_becomes_degraded_and_recovers(scenario):
    # blockSize 12, as an older CRD without the enum admitted it: the operator refuses it.
    scenario.api.create(pagedllm(scenario.ns, blockSize=12), unchecked=True)
    obj = scenario.wait_status(lambda s, o: s.get("phase") == "Degraded", "Degraded")
    degraded = condition(obj, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "spec.blockSize=12" in degraded["message"] and "[8, 16, 32, 64, 128]" in degraded["message"]
    assert obj["status"]["observedGeneration"] == 1
    assert scenario.get("Deployment") is None
    scenario.wait(lambda: [e for e in scenario.events() if e.get("reason") == "InvalidSpec"], "a warning event")
    assert scenario.operator.alive()

    scenario.api.patch(KIND, scenario.ns, "llama", {"spec": {"blockSize": 16}})
    scenario.wait_deployment()
    scenario.wait_status(
        lambda s, o: s.get("phase") == "Pending" and condition(o, "Degraded")["status"] == "False",
        "recovered to Pending",
    )


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
                        "image": "img",
                        "imageID": "",
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

    # The Deployment's status moves while the pod restarts: the resource still says why.
    report = {"status": {"observedGeneration": dep["metadata"]["generation"], "replicas": 1, "updatedReplicas": 1}}
    scenario.api.patch("Deployment", scenario.ns, "llama", report, sub="status")
    obj = scenario.wait_status(lambda s, o: s.get("replicas") == 1, "the Deployment's replicas reported")
    assert (obj["status"]["phase"], condition(obj, "Degraded")["reason"]) == ("Degraded", "ServerExited")
    # Once the replica is ready, the exit is history.
    scenario.api.patch("Deployment", scenario.ns, "llama", {"status": {"readyReplicas": 1}}, sub="status")
    scenario.wait_status(lambda s, o: s.get("phase") == "Ready", "Ready")


def test_extra_args_cannot_override_rendered_flags(scenario):
    scenario.api.create(pagedllm(scenario.ns, extraArgs=["--block-size", "64"]))
    obj = scenario.wait_status(lambda s, o: s.get("phase") == "Degraded", "Degraded")
    assert "spec.blockSize" in condition(obj, "Degraded")["message"]
    assert scenario.operator.alive()


def test_model_cache_renders_an_owned_claim(scenario):
    cache = {"size": "50Gi", "storageClassName": "fast", "retainPolicy": "Delete"}
    created = scenario.api.create(pagedllm(scenario.ns, modelCache=cache))
    claim = scenario.wait(lambda: scenario.get("PersistentVolumeClaim", "llama-model-cache"), "the claim")
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert claim["spec"]["storageClassName"] == "fast"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    volumes = scenario.wait_deployment()["spec"]["template"]["spec"]["volumes"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "llama-model-cache"}} in volumes


def test_network_policies_fence_the_pods_and_go_when_turned_off(scenario):
    cache = {"size": "50Gi", "accessMode": "ReadWriteMany"}
    created = scenario.api.create(pagedllm(scenario.ns, modelCache=cache))
    policy = scenario.wait(lambda: scenario.get("NetworkPolicy"), "the servers' NetworkPolicy")
    download = scenario.wait(lambda: scenario.get("NetworkPolicy", "llama-model-download"), "the download's")
    servers = scenario.wait_deployment()["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= servers.items()
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}], "from": [{"podSelector": {}}]}]
    (job,) = [j for j in scenario.api.list("Job", scenario.ns) if j["metadata"]["name"].startswith("llama-model-")]
    assert download["spec"]["podSelector"]["matchLabels"] == job["spec"]["template"]["metadata"]["labels"]
    assert (download["spec"]["policyTypes"], download["spec"].get("ingress", [])) == (["Ingress"], [])
    for obj in (policy, download):
        assert obj["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]

    # Opened by hand (a rule with no `from` admits every source): closed again.
    scenario.api.patch("NetworkPolicy", scenario.ns, "llama", {"spec": {"ingress": [{}]}})
    restored = policy["spec"]["ingress"]
    scenario.wait(lambda: (scenario.get("NetworkPolicy") or {})["spec"]["ingress"] == restored, "the policy reverted")

    scenario.api.patch(KIND, scenario.ns, "llama", {"spec": {"networkPolicy": {"enabled": False}}})
    scenario.wait(lambda: scenario.get("NetworkPolicy") is None, "the servers' NetworkPolicy deleted")
    scenario.wait(lambda: scenario.get("NetworkPolicy", "llama-model-download") is None, "the download's deleted")


# -- run last: they look back at everything the operator did in this module ---------------


def test_chart_rbac_grants_every_call_the_operator_made(cluster, helm_template):
    (role,) = [doc for doc in helm_template("--set", "clusterWide=true") if doc["kind"] == "ClusterRole"]
    granted, used = rules_of(role), cluster.operator_rbac_calls()
    assert used - granted == set(), f"calls the chart's RBAC does not allow: {sorted(used - granted)}"
    # The module exercised the operator enough for this to mean something.
    assert {
        ("apps", "deployments", "patch"),
        ("pagedllm.dev", "pagedllms/status", "patch"),
        ("", "events", "create"),
        ("pagedllm.dev", "pagedllms", "watch"),
    } <= used


def test_operator_logged_no_errors(operator):
    log = operator.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "[ERROR" not in log, operator.log(200)
    assert operator.alive()
