"""Model sources, the download Job and the cache claim (operator/artifacts.py), through render()."""

from __future__ import annotations

import pytest
from resource_factories import CONFIG, UID, body, pod, server

from pagedllm.operator.artifacts import model_status, model_status_patch
from pagedllm.operator.manifests import render
from pagedllm.operator.spec import SpecError

CACHE = {"size": "100Gi", "accessMode": "ReadWriteMany"}


def flag(m, name: str) -> str:
    args = server(m)["args"]
    return args[args.index(name) + 1]


def test_a_pinned_hub_revision_gets_its_own_directory():
    m = render(body(modelSource={"uri": "hf://org/llama", "revision": "refs/pr/1"}, model="llama"), CONFIG)
    (fetch,) = pod(m)["initContainers"]
    assert fetch["command"] == [
        "pagedllm",
        "download",
        "hf://org/llama",
        "/models/org/llama@refs--pr--1",
        "--revision",
        "refs/pr/1",
    ]
    assert flag(m, "--model") == "/models/org/llama@refs--pr--1"
    assert flag(m, "--served-model-name") == "llama"


def test_object_store_sources_get_credentials_in_the_download_only():
    m = render(body(modelSource={"uri": "s3://bucket/llama/7b", "credentialsSecret": {"name": "s3-creds"}}), CONFIG)
    (fetch,) = pod(m)["initContainers"]
    assert fetch["command"][2:4] == ["s3://bucket/llama/7b", "/models/s3/bucket/llama/7b"]
    assert fetch["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert "envFrom" not in server(m)
    assert flag(m, "--model") == "/models/s3/bucket/llama/7b"
    assert flag(m, "--served-model-name") == "meta-llama/Llama-2-7b-hf"  # spec.model names it


def test_a_pvc_uri_mounts_the_claim():
    m = render(body(modelSource={"uri": "pvc://weights/llama/7b"}), CONFIG)
    assert "initContainers" not in pod(m) and m.job is None
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod(m)["volumes"]
    assert {"name": "model", "mountPath": "/model", "readOnly": True, "subPath": "llama/7b"} in server(m)[
        "volumeMounts"
    ]


def test_a_shared_cache_is_filled_by_one_job_the_pods_wait_for():
    m = render(
        body(
            replicas=3,
            modelCache=CACHE,
            modelSource={"uri": "gs://b/m", "credentialsSecret": {"name": "gcs"}},
            nodeSelector={"gpu": "h100"},
        ),
        CONFIG,
    )
    job = m.job
    assert job["metadata"]["name"].startswith("llama-model-") and len(job["metadata"]["name"]) <= 63
    assert job["metadata"]["ownerReferences"][0]["uid"] == UID
    template = job["spec"]["template"]["spec"]
    assert template["restartPolicy"] == "Never" and template["nodeSelector"] == {"gpu": "h100"}
    assert {v["name"] for v in template["volumes"]} == {"models", "tmp", "home"}
    (download,) = template["containers"]
    assert download["command"] == ["pagedllm", "download", "gs://b/m", "/models/gs/b/m"]
    assert download["envFrom"] == [{"secretRef": {"name": "gcs"}}]
    (wait,) = pod(m)["initContainers"]
    assert wait["name"] == "wait-for-model" and wait["command"] == [*download["command"], "--wait"]
    assert "envFrom" not in wait  # only the download sees the credentials
    assert job["metadata"]["annotations"]["pagedllm.dev/model-source"] == "gs://b/m"


def test_a_new_revision_is_a_new_job():
    first = render(body(modelCache=CACHE, modelSource={"revision": "a"}), CONFIG).job["metadata"]["name"]
    again = render(body(modelCache=CACHE, modelSource={"revision": "a"}), CONFIG).job["metadata"]["name"]
    second = render(body(modelCache=CACHE, modelSource={"revision": "b"}), CONFIG).job["metadata"]["name"]
    assert first == again != second
    long = render(body(name="x" * 63, modelCache=CACHE), CONFIG).job["metadata"]["name"]
    assert len(long) <= 63


def test_retained_cache_has_no_owner_but_the_namespace_and_labels():
    m = render(body(modelCache=CACHE), CONFIG)
    assert "ownerReferences" not in m.pvc["metadata"]
    assert m.pvc["metadata"]["namespace"] == "ml"
    assert m.pvc["metadata"]["labels"]["app.kubernetes.io/instance"] == "llama"
    owned = render(body(modelCache={**CACHE, "retainPolicy": "Delete"}), CONFIG)
    assert owned.pvc["metadata"]["ownerReferences"][0]["uid"] == UID


def test_without_a_cache_there_is_no_job():
    assert render(body(), CONFIG).job is None
    assert render(body(model="/opt/m"), CONFIG).job is None


@pytest.mark.parametrize(
    "source, message",
    [
        (
            {"uri": "s3://b/p", "type": "huggingface"},
            r"spec.modelSource.uri='s3://b/p' is not allowed with spec.modelSource.type",
        ),
        (
            {"uri": "s3://b/p", "revision": "v1"},
            r"spec.modelSource.revision='v1' is not allowed with .*only hf:// sources have revisions",
        ),
        ({"uri": "ftp://b/p"}, r"spec.modelSource.uri='ftp://b/p' is not allowed: use hf://ORG/NAME"),
        ({"uri": "s3://b/../p"}, r"is not allowed: use hf://"),
        ({"uri": "pvc://Bad_Claim/x"}, r"the claim's name"),
        ({"revision": "../x"}, r"spec.modelSource.revision='../x' is not allowed"),
        ({"credentialsSecret": {"name": "Bad"}}, r"spec.modelSource.credentialsSecret.name='Bad' is not allowed"),
        ({"url": "s3://b/p"}, r"spec.modelSource has unknown field\(s\) \['url'\]"),
    ],
)
def test_sources_refused_say_what_and_why(source, message):
    with pytest.raises(SpecError, match=message):
        render(body(modelSource=source), CONFIG)


def test_retain_policy_is_checked():
    with pytest.raises(
        SpecError, match=r"spec.modelCache.retainPolicy='Keep' is not allowed: choose one of \['Retain', 'Delete'\]"
    ):
        render(body(modelCache={**CACHE, "retainPolicy": "Keep"}), CONFIG)


def job(status: dict | None = None) -> dict:
    annotations = {
        "pagedllm.dev/model-source": "hf://o/n",
        "pagedllm.dev/model-revision": "v1",
        "pagedllm.dev/model-path": "/models/o/n@v1",
    }
    return {"metadata": {"name": "llama-model-abc", "annotations": annotations}, "status": status or {}}


@pytest.mark.parametrize(
    "status, expected",
    [
        ({}, {"phase": "Pending"}),
        ({"active": 1}, {"phase": "Downloading", "attempts": 1}),
        ({"active": 1, "failed": 2}, {"phase": "Downloading", "attempts": 3}),
        ({"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}, {"phase": "Ready"}),
        (
            {
                "failed": 7,
                "conditions": [
                    {
                        "type": "Failed",
                        "status": "True",
                        "reason": "BackoffLimitExceeded",
                        "message": "Job has reached the specified backoff limit",
                    }
                ],
            },
            {
                "phase": "Failed",
                "message": "Job has reached the specified backoff limit; see kubectl logs job/llama-model-abc",
            },
        ),
        ({"active": 1, "conditions": [{"type": "Failed", "status": "False"}]}, {"phase": "Downloading", "attempts": 1}),
    ],
)
def test_the_jobs_status_becomes_status_model(status, expected):
    base = {"job": "llama-model-abc", "source": "hf://o/n", "revision": "v1", "path": "/models/o/n@v1"}
    assert model_status(job(status)) == {**base, **expected}


def test_the_status_patch_clears_what_no_longer_applies():
    before = model_status(job({"active": 1}))
    patch = model_status_patch(before, job({"succeeded": 1}))
    assert patch["phase"] == "Ready" and patch["attempts"] is None  # a merge patch deletes it
    assert model_status_patch(None, job({})) == model_status(job({}))
