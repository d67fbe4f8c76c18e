"""CPU, memory and volume sizes derived from the model (operator/resources.py), through render()."""

from __future__ import annotations

import pytest
from resource_factories import CONFIG, body, pod, server

from pagedllm.operator.manifests import render
from pagedllm.operator.spec import SpecError


def volume(m, name: str) -> dict:
    return next(v for v in pod(m)["volumes"] if v["name"] == name)


@pytest.mark.parametrize(
    "spec, cpu, memory",
    [
        ({}, "4", "24Gi"),  # 4 + 16 (default checkpoint) + 4 swap
        ({"swapSpaceGiB": 0}, "4", "20Gi"),
        ({"modelSource": {"sizeGiB": 13.5}}, "4", "22Gi"),  # 4 + 14 + 4
        ({"modelSource": {"sizeGiB": 140}, "tensorParallelSize": 8, "swapSpaceGiB": 2.5}, "18", "180Gi"),  # 4+140+20+16
        ({"tensorParallelSize": 2, "swapSpaceGiB": 0.5}, "6", "25Gi"),  # 4 + 16 + 1 + 4 shm
    ],
)
def test_memory_follows_model_swap_and_shm(spec, cpu, memory):
    resources = server(render(body(**spec), CONFIG))["resources"]
    assert resources["requests"]["cpu"] == cpu
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == memory
    assert "cpu" not in resources["limits"]  # NOTE: no CPU limit: throttling the step loop costs latency


def test_pods_are_never_best_effort():
    for spec in ({}, {"model": "/opt/m"}, {"modelSource": {"type": "pvc", "pvc": {"claimName": "w"}}}):
        for container in pod(render(body(**spec), CONFIG))["containers"]:
            assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]


def test_spec_resources_override_per_name():
    resources = server(render(body(resources={"requests": {"memory": "100Gi"}, "limits": {"cpu": "8"}}), CONFIG))[
        "resources"
    ]
    # memory: the request given, no derived limit; cpu: the limit given (Kubernetes makes it the request too)
    assert resources["requests"] == {"memory": "100Gi", "nvidia.com/gpu": 1}
    assert resources["limits"] == {"cpu": "8", "nvidia.com/gpu": 1}


def test_other_resources_keep_the_derived_ones():
    resources = server(render(body(resources={"limits": {"ephemeral-storage": "50Gi"}}), CONFIG))["resources"]
    assert resources["limits"] == {"memory": "24Gi", "ephemeral-storage": "50Gi", "nvidia.com/gpu": 1}
    assert resources["requests"]["cpu"] == "4"


def test_size_limits_on_the_memory_and_download_volumes():
    m = render(body(tensorParallelSize=4, modelSource={"sizeGiB": 30}), CONFIG)
    assert volume(m, "dshm")["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert volume(m, "models")["emptyDir"] == {"sizeLimit": "37Gi"}  # 30 x 1.2 + 1
    cached = render(body(modelCache={"size": "50Gi"}), CONFIG)
    assert volume(cached, "models") == {"name": "models", "persistentVolumeClaim": {"claimName": "llama-model-cache"}}


def test_the_download_has_resources():
    (fetch,) = pod(render(body(), CONFIG))["initContainers"]
    assert fetch["resources"] == {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}
    m = render(body(modelCache={"size": "50Gi"}), CONFIG)
    (wait,) = pod(m)["initContainers"]
    assert wait["resources"]["requests"] and wait["resources"]["limits"]["memory"]
    (download,) = m.job["spec"]["template"]["spec"]["containers"]
    assert download["resources"] == fetch["resources"]


@pytest.mark.parametrize("size", [0, -1, "13", True, 70000])
def test_model_size_must_be_a_positive_number(size):
    with pytest.raises(SpecError, match=r"spec.modelSource.sizeGiB=.* is out of range"):
        render(body(modelSource={"sizeGiB": size}), CONFIG)
