"""What the operator renders from a spec, seen through the emulated API server.

extraArgs abbreviations, rollout strategies, pod resources, the model-cache Job and the
claim's retain policy, each by a real operator process against kmock over HTTP.
"""

from __future__ import annotations

import pytest
from emulated_scenario import KIND, condition, pagedllm, server_container

pytestmark = pytest.mark.k8s


def degraded_message(scenario, name: str = "llama") -> str:
    obj = scenario.wait_status(
        lambda s, o: condition(o, "Degraded").get("status") == "True", f"{name} Degraded", name=name
    )
    degraded = condition(obj, "Degraded")
    assert degraded["reason"] == "InvalidSpec" and obj["status"]["phase"] == "Degraded"
    return degraded["message"]


# Every owned flag and every abbreviation of it goes through render() (whose SpecError is this
# condition's message) in test_server_command.py; a resource per abbreviation here would take minutes.
@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--tensor-parallel", "4"], "--tensor-parallel-size"),
        (["--api-ke", "k"], "--api-key"),
        (["--ho", "127.0.0.1"], "--host"),
        (["--block=64"], "--block-size"),
    ],
)
def test_abbreviations_degrade(scenario, extra, flag):
    scenario.api.create(pagedllm(scenario.ns, extraArgs=extra))
    message = degraded_message(scenario)
    assert f"spec.extraArgs[0]={extra[0]!r} is not allowed: {extra[0].split('=')[0]} abbreviates {flag}" in message
    assert scenario.get("Deployment") is None


def test_a_fleet_rolls_one_pod_at_a_time_without_spare_gpus(scenario):
    scenario.api.create(pagedllm(scenario.ns, replicas=3))
    deployment = scenario.wait_deployment()
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    scenario.api.patch(KIND, scenario.ns, "llama", {"spec": {"rollout": {"maxSurge": "25%", "maxUnavailable": 0}}})
    scenario.wait_deployment(
        lambda d: d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": "25%", "maxUnavailable": 0},
        "the rollout bounds of spec.rollout",
    )


def test_a_read_write_once_cache_with_a_surge_is_refused(scenario):
    scenario.api.create(pagedllm(scenario.ns, modelCache={"size": "20Gi"}, rollout={"maxSurge": 1}))
    message = degraded_message(scenario)
    assert "spec.rollout.maxSurge=1 is not allowed with a ReadWriteOnce spec.modelCache" in message
    assert "Multi-Attach" in message
    assert scenario.get("Deployment") is None

    scenario.api.patch(KIND, scenario.ns, "llama", {"spec": {"rollout": {"maxSurge": 0}}})
    deployment = scenario.wait_deployment()
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }


def test_pods_request_cpu_and_memory(scenario):
    scenario.api.create(pagedllm(scenario.ns, tensorParallelSize=2, swapSpaceGiB=4, modelSource={"sizeGiB": 13.5}))
    deployment = scenario.wait_deployment()
    resources = server_container(deployment)["resources"]
    # 4 base + 14 checkpoint + 4 x 2 swap + 2 x 2 /dev/shm
    assert resources["requests"] == {"cpu": "6", "memory": "30Gi", "nvidia.com/gpu": 2}
    assert resources["limits"] == {"memory": "30Gi", "nvidia.com/gpu": 2}
    (fetch,) = deployment["spec"]["template"]["spec"]["initContainers"]
    assert fetch["resources"]["requests"] == {"cpu": "1", "memory": "1Gi"}


def test_a_retained_cache_outlives_its_resource_and_a_job_fills_it(scenario):
    created = scenario.api.create(pagedllm(scenario.ns, modelCache={"size": "20Gi"}))
    claim = scenario.wait(lambda: scenario.get("PersistentVolumeClaim", "llama-model-cache"), "the cache claim")
    assert not claim["metadata"].get("ownerReferences")  # Retain, the default
    job = scenario.wait(lambda: scenario.api.list("Job", scenario.ns), "the download Job")[0]
    assert job["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    (download,) = job["spec"]["template"]["spec"]["containers"]
    assert download["command"][:3] == ["pagedllm", "download", "hf://meta-llama/Llama-2-7b-hf"]
    deployment = scenario.wait_deployment()
    (wait,) = deployment["spec"]["template"]["spec"]["initContainers"]
    assert wait["name"] == "wait-for-model" and wait["command"][-1] == "--wait"
    scenario.wait_status(lambda s, o: (s.get("model") or {}).get("job") == job["metadata"]["name"], "status.model")

    scenario.api.delete(KIND, scenario.ns, "llama")
    scenario.wait(lambda: scenario.get("Deployment") is None and not scenario.api.list("Job", scenario.ns), "cascade")
    assert scenario.get("PersistentVolumeClaim", "llama-model-cache")["metadata"]["uid"] == claim["metadata"]["uid"]


def test_a_cache_with_the_delete_policy_goes_with_its_resource(scenario):
    scenario.api.create(pagedllm(scenario.ns, modelCache={"size": "20Gi", "retainPolicy": "Delete"}))
    claim = scenario.wait(lambda: scenario.get("PersistentVolumeClaim", "llama-model-cache"), "the cache claim")
    assert claim["metadata"]["ownerReferences"][0]["controller"] is True
    scenario.wait_deployment()

    scenario.api.delete(KIND, scenario.ns, "llama")
    scenario.wait(lambda: scenario.get("PersistentVolumeClaim", "llama-model-cache") is None, "the claim deleted")


def test_download_progress_reaches_the_status(scenario):
    scenario.api.create(pagedllm(scenario.ns, modelCache={"size": "20Gi"}, modelSource={"revision": "v1.0"}))
    job = scenario.wait(lambda: scenario.api.list("Job", scenario.ns), "the download Job")[0]
    name = job["metadata"]["name"]
    scenario.wait_status(lambda s, o: (s.get("model") or {}).get("phase") == "Pending", "model Pending")

    scenario.api.patch("Job", scenario.ns, name, {"status": {"active": 1, "failed": 1}}, sub="status")
    obj = scenario.wait_status(lambda s, o: (s.get("model") or {}).get("phase") == "Downloading", "Downloading")
    assert obj["status"]["model"]["attempts"] == 2 and obj["status"]["model"]["revision"] == "v1.0"

    failed = {
        "type": "Failed",
        "status": "True",
        "reason": "BackoffLimitExceeded",
        "message": "Job has reached the specified backoff limit",
    }
    scenario.api.patch(
        "Job", scenario.ns, name, {"status": {"active": 0, "failed": 7, "conditions": [failed]}}, sub="status"
    )
    obj = scenario.wait_status(lambda s, o: (s.get("model") or {}).get("phase") == "Failed", "Failed")
    assert "backoff limit" in obj["status"]["model"]["message"] and f"job/{name}" in obj["status"]["model"]["message"]
    assert "attempts" not in obj["status"]["model"]


def test_an_extra_arg_the_server_refuses_degrades_and_rolls_nothing(scenario):
    scenario.api.create(pagedllm(scenario.ns))
    before = scenario.wait_deployment()
    template = before["spec"]["template"]
    scenario.api.patch(KIND, scenario.ns, "llama", {"spec": {"extraArgs": ["--enable-chunked-prefil"]}})
    message = degraded_message(scenario)
    assert message.startswith("spec.extraArgs[0]='--enable-chunked-prefil' is refused by pagedllm serve: ")
    assert "unrecognized arguments: --enable-chunked-prefil" in message
    assert scenario.get("Deployment")["spec"]["template"] == template  # nothing rolled
