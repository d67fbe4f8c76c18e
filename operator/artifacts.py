"""A resource's model files: where they come from, where the server reads them, who fetches them.

    source (spec)                   fetched by                         server reads
    hf id / hf://ORG/NAME[@rev]     `pagedllm download`                /models/ORG/NAME[@rev]
    s3://BUCKET/PREFIX              `pagedllm download` (aws CLI)      /models/s3/BUCKET/PREFIX
    gs://BUCKET/PREFIX              `pagedllm download` (gcloud CLI)   /models/gs/BUCKET/PREFIX
    pvc / pvc://CLAIM/PATH          (nothing: mounted read-only)       /model
    absolute path                   (nothing: in the image)            the path

Without ``spec.modelCache`` each pod downloads into its own emptyDir (init container
``fetch-model``). With it, one Job (``NAME-model-HASH``) downloads into the shared claim
and every pod's init container ``wait-for-model`` waits for the download's completion
marker (:data:`pagedllm.server.entrypoints.download.MARKER`).

NOTE: the pods wait for the marker; the operator does not hold the Deployment back until the
Job completes. The rendering stays a pure function of the spec (no Deployment that appears
only after a Job event, nothing to re-render when a Job finishes), the Deployment and its
status exist from the start, and the marker is what the pods actually need: it is written
after the last file, so a cache filled by an earlier Job (or a claim kept by
``retainPolicy: Retain``) is used at once, and a Job cut short is never mistaken for a full
cache. With a ReadWriteOnce claim a waiting pod on another node than the Job's pod cannot
attach the claim until that pod ends; it then starts as usual (Kubernetes retries the attach).

The Job's name carries a hash of its pod template, which a Job cannot change: a new
source, revision or image gets a new Job (it finds the files, if they are there, and ends
at once); earlier Jobs stay, owned by the resource, until it is deleted.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pagedllm.operator.spec import PagedLLMSpec

MODELS_DIR = "/models"
MODEL_MOUNT = "/model"
DOWNLOAD_COMMAND = ("pagedllm", "download")
FETCH_CONTAINER, WAIT_CONTAINER, JOB_CONTAINER = "fetch-model", "wait-for-model", "download"
JOB_BACKOFF_LIMIT = 6


def source_uri(spec: PagedLLMSpec) -> str:
    """The download's source, as `pagedllm download` takes it (only when ``spec.downloads``)."""
    source = spec.model_source
    if source.type == "huggingface":
        return f"hf://{source.location or spec.model}"
    return f"{source.type}://{source.location}"


def cache_key(spec: PagedLLMSpec) -> str:
    """The directory under /models the download goes into: one per source and revision."""
    source = spec.model_source
    if source.type != "huggingface":
        return f"{source.type}/{source.location}"
    key = source.location or spec.model
    # NOTE: a branch may hold '/' (refs/pr/1): one directory per revision, never nested.
    return f"{key}@{source.revision.replace('/', '--')}" if source.revision else key


def model_path(spec: PagedLLMSpec) -> str:
    """Where the server finds the checkpoint inside its container."""
    if spec.uses_pvc_source:
        return MODEL_MOUNT
    if not spec.downloads:
        return spec.model
    return f"{MODELS_DIR}/{cache_key(spec)}"


def download_args(spec: PagedLLMSpec, *, wait: bool = False) -> list[str]:
    """``pagedllm download`` arguments: fetch into (or, ``wait``, wait for) :func:`model_path`."""
    revision = spec.model_source.revision
    return (
        [*DOWNLOAD_COMMAND, source_uri(spec), model_path(spec)]
        + (["--revision", revision] if revision else [])
        + (["--wait"] if wait else [])
    )


def credentials_env_from(spec: PagedLLMSpec) -> list[dict]:
    secret = spec.model_source.credentials_secret
    return [{"secretRef": {"name": secret}}] if secret else []


def uses_download_job(spec: PagedLLMSpec) -> bool:
    """A shared cache is filled once by a Job; without one each pod downloads for itself."""
    return spec.downloads and spec.model_cache is not None


def download_job_name(name: str, pod_template: Mapping[str, Any]) -> str:
    """``NAME-model-HASH``: the hash of the Job's (immutable) pod template; at most 63 characters
    (the Job controller labels its pods with the name)."""
    digest = hashlib.sha256(json.dumps(pod_template, sort_keys=True).encode()).hexdigest()[:10]
    return f"{name[:46].rstrip('-')}-model-{digest}"


# Annotations of the download Job: what it downloads, for status.model (read from the Job alone).
SOURCE_ANNOTATION, REVISION_ANNOTATION, PATH_ANNOTATION = (
    "pagedllm.dev/model-source",
    "pagedllm.dev/model-revision",
    "pagedllm.dev/model-path",
)


def render_download_job(
    name: str, spec: PagedLLMSpec, pod_spec: dict, labels: Mapping[str, str], pod_labels: Mapping[str, str]
) -> dict:
    """The Job that fills the cache once, running ``pod_spec`` (its one container is the download).

    NOTE: its pods carry ``pod_labels``, not the servers' selector: the Service, the budget and
    the servers' NetworkPolicy must never take a download pod for a server.
    """
    template = {"metadata": {"labels": dict(pod_labels)}, "spec": {**pod_spec, "restartPolicy": "Never"}}
    annotations = {SOURCE_ANNOTATION: source_uri(spec), PATH_ANNOTATION: model_path(spec)}
    if spec.model_source.revision:
        annotations[REVISION_ANNOTATION] = spec.model_source.revision
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": download_job_name(name, template),
            "labels": dict(labels),
            "annotations": annotations,
        },
        "spec": {"backoffLimit": JOB_BACKOFF_LIMIT, "template": template},
    }


# status.model.phase
MODEL_PENDING, MODEL_DOWNLOADING, MODEL_READY, MODEL_FAILED = "Pending", "Downloading", "Ready", "Failed"


def model_status(job: Mapping[str, Any]) -> dict[str, Any]:
    """``status.model`` from the download Job as the API last showed it.

    Pending (no pod running yet), Downloading (a pod runs), Ready (the cache holds the files),
    Failed (out of retries; the message is the Job's). Only resources with a download Job have one.
    """
    meta = job.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    out: dict[str, Any] = {"job": meta.get("name")}
    for key, annotation in (
        ("source", SOURCE_ANNOTATION),
        ("revision", REVISION_ANNOTATION),
        ("path", PATH_ANNOTATION),
    ):
        if annotation in annotations:
            out[key] = annotations[annotation]
    status = job.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    if "Complete" in conditions or int(status.get("succeeded") or 0) > 0:
        return {**out, "phase": MODEL_READY}
    if "Failed" in conditions:
        failed = conditions["Failed"]
        said = failed.get("message") or failed.get("reason") or "the download failed"
        return {**out, "phase": MODEL_FAILED, "message": f"{said}; see kubectl logs job/{out['job']}"}
    if int(status.get("active") or 0) > 0:
        return {**out, "phase": MODEL_DOWNLOADING, "attempts": int(status.get("failed") or 0) + 1}
    return {**out, "phase": MODEL_PENDING}


def model_status_patch(current: Mapping[str, Any] | None, job: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`model_status` as a merge patch over ``current`` (status.model now): keys it no longer
    has are set to null, or a merge patch would keep them (an old failure message, say)."""
    new = model_status(job)
    return {**{key: None for key in current or {} if key not in new}, **new}
