"""Rendering: a ``PagedLLM`` resource -> its Deployment, Service and model-cache claim.

Pure functions: the same resource and :class:`RenderConfig` always give the same
manifests, and nothing here talks to the API. The handlers apply the result.

Volumes of a server pod::

    huggingface id   /models  <- NAME-model-cache claim (spec.modelCache) or an emptyDir;
                              the fetch-model init container downloads into /models/<id>
    pvc source       /model   <- spec.modelSource.pvc.claimName, subPath pvc.path, read-only
    absolute path    (none)      the checkpoint is in the image
    TP > 1           /dev/shm <- emptyDir(medium=Memory), for NCCL between the ranks
    always           /tmp, /home/pagedllm <- emptyDirs: the root filesystem is read-only, and
                              Triton, torch and the Hub client write caches under $HOME and /tmp
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from pagedllm.operator.adapters import adapter_mounts
from pagedllm.operator.adapters import downloads as adapter_downloads
from pagedllm.operator.autoscaling import AUTOSCALERS, HPA
from pagedllm.operator.command import SERVE_COMMAND, check_engine, server_args
from pagedllm.operator.container_env import downloads, gpu_resources, hub_env, server_env
from pagedllm.operator.fleet import Fleet, FleetConfig, render_fleet
from pagedllm.operator.monitoring import scrape_annotations
from pagedllm.operator.placement import pod_metadata, pod_placement
from pagedllm.operator.spec import PagedLLMSpec
from pagedllm.operator.spec_fields import dns_label

GROUP, VERSION, PLURAL, KIND = "pagedllm.dev", "v1alpha1", "pagedllms", "PagedLLM"
MANAGED_BY = "pagedllm-operator"
GENERATION_ANNOTATION = "pagedllm.dev/generation"
SERVER_CONTAINER = "server"
MODELS_DIR = "/models"
MODEL_MOUNT = "/model"
RUN_AS = 1000  # the image's non-root user (Dockerfile: USER 1000)
HOME_DIR = "/home/pagedllm"  # the image's $HOME (Dockerfile), writable through an emptyDir

# Seconds between the server's drain deadline and the kubelet's SIGKILL.
GRACE_MARGIN_SECONDS = 30
PRESTOP_SLEEP_SECONDS = 5
# Extra time a rollout may take beyond the startup budget: scheduling, image pull and the
# model download all happen before the startup probe starts counting.
PROGRESS_MARGIN_SECONDS = 1800
STARTUP_PROBE_PERIOD = 10


# The init container's download: the Hub client ships with transformers in the image.
FETCH_SCRIPT = (
    "import sys\n"
    "from huggingface_hub import snapshot_download\n"
    "for repo, dest in zip(sys.argv[1::2], sys.argv[2::2]):\n"
    "    snapshot_download(repo_id=repo, local_dir=dest, ignore_patterns=['original/*'])\n"
)
"""Downloads ``repo dest`` pairs: the model, then each Hub adapter (``spec.adapters``)."""


DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"


@dataclass(frozen=True)
class RenderConfig:
    """Operator-wide rendering settings (from `pagedllm operator` flags)."""

    default_image: str
    """Server image of resources without spec.image."""
    autoscaler: str = HPA
    """What spec.autoscaling renders to: hpa (HorizontalPodAutoscaler) or keda (ScaledObject)."""
    prometheus_address: str = DEFAULT_PROMETHEUS
    """Prometheus that KEDA's triggers query."""
    pod_monitor_labels: tuple[tuple[str, str], ...] = ()
    """Extra labels of every PodMonitor, the ones the cluster's Prometheus selects them by."""

    def __post_init__(self) -> None:
        if self.autoscaler not in AUTOSCALERS:
            raise ValueError(f"autoscaler={self.autoscaler!r} is not allowed: choose one of {list(AUTOSCALERS)}")


@dataclass(frozen=True)
class Manifests:
    """Everything one resource renders to; ``pvc`` only with spec.modelCache."""

    deployment: dict
    service: dict
    pvc: dict | None = None
    fleet: Fleet | None = None

    def all(self) -> list[dict]:
        """In apply order: the claim before the pods that mount it, the fleet objects after them."""
        core = [m for m in (self.pvc, self.deployment, self.service) if m is not None]
        return core + (self.fleet.all() if self.fleet is not None else [])


def as_body(obj: Mapping[str, Any]) -> kopf.Body:
    """kopf's typed view of a plain object, for its adoption and event helpers."""
    return kopf.Body(dict(obj))  # type: ignore[arg-type]  # NOTE: kopf's RawBody is a TypedDict of this dict


def labels(name: str) -> dict[str, str]:
    """Labels of everything rendered for the resource ``name``."""
    return {
        **selector_labels(name),
        "app.kubernetes.io/component": "server",
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


INSTANCE_LABEL = "app.kubernetes.io/instance"


def selector_labels(name: str) -> dict[str, str]:
    """The Deployment's (immutable) selector and the Service's selector."""
    return {"app.kubernetes.io/name": "pagedllm", INSTANCE_LABEL: name}


def selector_string(name: str) -> str:
    """:func:`selector_labels` in the serialized form of status.selector (for HPAs)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def endpoint(name: str, namespace: str, port: int) -> str:
    return f"http://{name}.{namespace}.svc:{port}"


def cache_claim_name(name: str) -> str:
    return f"{name}-model-cache"


def model_path(spec: PagedLLMSpec) -> str:
    """Where the server finds the checkpoint inside its container."""
    if spec.uses_pvc_source:
        return MODEL_MOUNT
    if spec.model_is_path:
        return spec.model
    return f"{MODELS_DIR}/{spec.model}"


def render(body: Mapping[str, Any], config: RenderConfig) -> Manifests:
    """Render a ``PagedLLM`` resource; raise :class:`SpecError` if it cannot be served."""
    meta = body.get("metadata", {})
    name = dns_label("metadata.name", meta.get("name", ""), "the Service")
    spec = PagedLLMSpec.from_dict(body.get("spec"))
    check_engine(spec, model_path(spec))
    generation = meta.get("generation")
    fleet_config = FleetConfig(config.autoscaler, config.prometheus_address, config.pod_monitor_labels)
    fleet = render_fleet(name, meta.get("namespace", ""), spec, selector_labels(name), fleet_config)
    for obj in fleet.all():
        obj["metadata"]["labels"] = {**obj["metadata"].get("labels", {}), **labels(name)}
    manifests = Manifests(
        deployment=render_deployment(name, spec, config, generation),
        service=render_service(name, spec),
        pvc=render_pvc(name, spec) if spec.model_cache is not None else None,
        fleet=fleet,
    )
    kopf.adopt(manifests.all(), owner=as_body(body))
    return manifests


def render_service(name: str, spec: PagedLLMSpec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels(name)},
        "spec": {
            "type": spec.service_type,
            "selector": selector_labels(name),
            "ports": [{"name": "http", "port": spec.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_pvc(name: str, spec: PagedLLMSpec) -> dict:
    cache = spec.model_cache
    assert cache is not None  # only called with spec.modelCache
    claim_spec: dict[str, Any] = {
        "accessModes": [cache.access_mode],
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class_name is not None:
        claim_spec["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": cache_claim_name(name), "labels": labels(name)},
        "spec": claim_spec,
    }


def render_deployment(name: str, spec: PagedLLMSpec, config: RenderConfig, generation: int | None) -> dict:
    annotations = {GENERATION_ANNOTATION: str(generation)} if generation is not None else {}
    pod_meta = pod_metadata(spec, labels(name))
    # NOTE: the scrape annotations win over spec.podAnnotations: they must name the server's port.
    pod_meta["annotations"] = {**pod_meta.get("annotations", {}), **scrape_annotations(spec.port)}
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(name)},
        "strategy": _strategy(spec),
        "progressDeadlineSeconds": spec.startup_timeout_seconds + PROGRESS_MARGIN_SECONDS,
        "revisionHistoryLimit": 3,
        "template": {"metadata": pod_meta, "spec": _pod_spec(name, spec, config)},
    }
    # NOTE: under an autoscaler, replicas are left out so that server-side apply neither sets
    # nor owns them: the autoscaler's count stands through every re-apply.
    if spec.fixed_replicas is not None:
        deployment_spec = {"replicas": spec.fixed_replicas, **deployment_spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels(name), "annotations": annotations},
        "spec": deployment_spec,
    }


def _strategy(spec: PagedLLMSpec) -> dict:
    if spec.rollout_strategy == "Recreate":
        return {"type": "Recreate"}
    # NOTE: maxUnavailable 0 keeps serving through a rollout; it needs one replica's GPUs spare.
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def _pod_spec(name: str, spec: PagedLLMSpec, config: RenderConfig) -> dict:
    volumes, mounts = _volumes(name, spec)
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the server never talks to the API
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "fsGroup": RUN_AS,
            "fsGroupChangePolicy": "OnRootMismatch",  # NOTE: no slow recursive chown of a big model cache
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # NOTE: longer than the pre-stop pause plus the server's drain timeout, so in-flight requests finish.
        "terminationGracePeriodSeconds": PRESTOP_SLEEP_SECONDS + spec.drain_timeout_seconds + GRACE_MARGIN_SECONDS,
        "containers": [_server_container(spec, config, mounts)],
        "volumes": volumes,
    }
    if downloads(spec):
        pod["initContainers"] = [_fetch_container(spec, config, mounts)]
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.affinity:
        pod["affinity"] = dict(spec.affinity)
    pod.update(pod_placement(spec, selector_labels(name)))
    return pod


def _volumes(name: str, spec: PagedLLMSpec) -> tuple[list[dict], list[dict]]:
    volumes: list[dict] = []
    mounts: list[dict] = []
    if spec.uses_pvc_source:
        pvc = spec.model_source.pvc
        assert pvc is not None  # guaranteed by PagedLLMSpec parsing
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": True}})
        mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
        mounts.append({**mount, "subPath": pvc.path} if pvc.path else mount)
        mounts.extend(adapter_mounts(spec.adapters))
    elif downloads(spec):
        source = (
            {"persistentVolumeClaim": {"claimName": cache_claim_name(name)}}
            if spec.model_cache is not None
            else {"emptyDir": {}}
        )
        volumes.append({"name": "models", **source})
        mounts.append({"name": "models", "mountPath": MODELS_DIR})
    if spec.tensor_parallel_size > 1:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    for volume, path in WRITABLE_DIRS:
        volumes.append({"name": volume, "emptyDir": {}})
        mounts.append({"name": volume, "mountPath": path})
    return volumes, mounts


# Writable emptyDirs under the read-only root filesystem: (volume, mount path).
WRITABLE_DIRS = (("tmp", "/tmp"), ("home", HOME_DIR))


def _container_security() -> dict:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def _server_container(spec: PagedLLMSpec, config: RenderConfig, mounts: list[dict]) -> dict:
    http = {"path": "/ready", "port": "http"}
    container = {
        "name": SERVER_CONTAINER,
        "image": spec.image or config.default_image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(SERVE_COMMAND),
        "args": server_args(spec, model_path(spec)),
        # A start-up refusal (e.g. a tensor-parallel size the model's heads cannot split into)
        # is written to the termination log, so the pod's last state says why it exited.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Endpoints drop a terminating pod asynchronously: keep serving a few seconds before
        # SIGTERM starts the drain, so no new request is routed to a server that refuses it.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
        "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}],
        "env": server_env(spec),
        "resources": gpu_resources(spec),
        # The startup budget covers loading weights and profiling memory; /ready answers
        # only once a forward pass is done. Liveness uses /health, alive while loading.
        "startupProbe": {
            "httpGet": http,
            "periodSeconds": STARTUP_PROBE_PERIOD,
            "timeoutSeconds": 5,
            "failureThreshold": math.ceil(spec.startup_timeout_seconds / STARTUP_PROBE_PERIOD),
        },
        "readinessProbe": {"httpGet": http, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }
    return container


def _fetch_container(spec: PagedLLMSpec, config: RenderConfig, mounts: list[dict]) -> dict:
    return {
        "name": "fetch-model",
        "image": spec.image or config.default_image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["python", "-c", FETCH_SCRIPT, spec.model, model_path(spec), *adapter_downloads(spec.adapters)],
        "env": hub_env(spec),
        "securityContext": _container_security(),
        "volumeMounts": [m for m in mounts if m["name"] in ("models", "tmp", "home")],
    }
