"""Rendering: a ``PagedLLM`` resource -> its Deployment, Service, model-cache claim and download Job.

Pure functions: the same resource and :class:`RenderConfig` always give the same
manifests, and nothing here talks to the API. The handlers apply the result.

Volumes of a server pod::

    hf, s3, gs       /models  <- NAME-model-cache claim (spec.modelCache; a Job fills it and the
                              wait-for-model init container waits) or an emptyDir (sizeLimit
                              from the model's size; the fetch-model init container downloads)
    pvc source       /model   <- spec.modelSource.pvc.claimName, subPath pvc.path, read-only
    absolute path    (none)      the checkpoint is in the image
    TP > 1           /dev/shm <- emptyDir(medium=Memory, sizeLimit), for NCCL between the ranks
    always           /tmp, /home/pagedllm <- emptyDirs: the root filesystem is read-only, and
                              Triton, torch and the Hub client write caches under $HOME and /tmp
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from pagedllm.operator.adapters import (
    adapter_download_args,
    adapter_mounts,
    download_adapter_env,
    render_adapters_config_map,
    server_adapter_env,
)
from pagedllm.operator.artifacts import (
    FETCH_CONTAINER,
    JOB_CONTAINER,
    MODEL_MOUNT,
    MODELS_DIR,
    WAIT_CONTAINER,
    credentials_env_from,
    download_args,
    model_path,
    render_download_job,
    uses_download_job,
)
from pagedllm.operator.autoscaling import AUTOSCALERS, HPA
from pagedllm.operator.command import SERVE_COMMAND, check_engine, server_args
from pagedllm.operator.container_env import hub_env, server_env
from pagedllm.operator.endpoint_picker import DEFAULT_PICKER_IMAGE, picker_labels
from pagedllm.operator.fleet import Fleet, FleetConfig, render_fleet
from pagedllm.operator.keda_http import parse_interceptor
from pagedllm.operator.labels import INSTANCE_LABEL as INSTANCE_LABEL
from pagedllm.operator.labels import MANAGED_BY as MANAGED_BY
from pagedllm.operator.labels import download_pod_labels, labels, selector_labels, server_pod_labels
from pagedllm.operator.labels import selector_string as selector_string
from pagedllm.operator.leaderworkerset import spread_over_nodes, wants_leaderworkerset
from pagedllm.operator.monitoring import scrape_annotations
from pagedllm.operator.network_policy import render_network_policies
from pagedllm.operator.placement import pod_metadata, pod_placement
from pagedllm.operator.pod_security import RUN_AS as RUN_AS
from pagedllm.operator.pod_security import container_security, pod_security
from pagedllm.operator.resources import download_resources, models_size_limit, server_resources, shm_gib
from pagedllm.operator.spec import PagedLLMSpec
from pagedllm.operator.spec_fields import dns_label

GROUP, VERSION, PLURAL, KIND = "pagedllm.dev", "v1alpha1", "pagedllms", "PagedLLM"
GENERATION_ANNOTATION = "pagedllm.dev/generation"
SERVER_CONTAINER = "server"
HOME_DIR = "/home/pagedllm"  # the image's $HOME (Dockerfile), writable through an emptyDir

# Seconds between the server's drain deadline and the kubelet's SIGKILL.
GRACE_MARGIN_SECONDS = 30
PRESTOP_SLEEP_SECONDS = 5
# Extra time a rollout may take beyond the startup budget: scheduling, image pull and the
# model download all happen before the startup probe starts counting.
PROGRESS_MARGIN_SECONDS = 1800
STARTUP_PROBE_PERIOD = 10


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
    endpoint_picker_image: str = DEFAULT_PICKER_IMAGE
    """Image of the endpoint pickers deployed for spec.routing.endpointPicker.deploy."""
    network_policies: bool = True
    """Render each resource's NetworkPolicies (spec.networkPolicy.enabled turns one resource's off)."""
    network_policy_namespaces: tuple[str, ...] = ()
    """Namespaces whose pods may always reach every API port (Prometheus, a Gateway's proxies)."""
    operator_namespace: str | None = None
    """Where the operator's pods run: with LoRA on they may reach the API port (they load adapters)."""
    http_interceptor: str | None = None
    """KEDA's HTTP add-on interceptor proxy, SERVICE.NAMESPACE:PORT (keda_http.py); None: not installed."""

    def __post_init__(self) -> None:
        if self.autoscaler not in AUTOSCALERS:
            raise ValueError(f"autoscaler={self.autoscaler!r} is not allowed: choose one of {list(AUTOSCALERS)}")
        if self.http_interceptor is not None:
            parse_interceptor(self.http_interceptor)


@dataclass(frozen=True)
class Manifests:
    """Everything one resource renders to; ``pvc`` and ``job`` only with spec.modelCache (and a download)."""

    deployment: dict
    """The server pods' owner: a Deployment, or a LeaderWorkerSet when replicas span nodes."""
    service: dict
    pvc: dict | None = None
    fleet: Fleet | None = None
    job: dict | None = None
    network_policies: tuple[dict, ...] = ()
    """Who may connect to the server and download pods, and where they may connect."""
    adapters: dict | None = None
    """The ConfigMap of LoRA adapters that pods read at start (only while LoRA is on)."""

    def all(self) -> list[dict]:
        """In apply order: the claim, the network policies and the adapter list before the Job and pods
        that use them, the fleet objects after them."""
        first = (self.pvc, *self.network_policies, self.adapters)
        core = [m for m in (*first, self.job, self.deployment, self.service) if m]
        return core + (self.fleet.all() if self.fleet is not None else [])


def as_body(obj: Mapping[str, Any]) -> kopf.Body:
    """kopf's typed view of a plain object, for its adoption and event helpers."""
    return kopf.Body(dict(obj))  # type: ignore[arg-type]  # NOTE: kopf's RawBody is a TypedDict of this dict


def endpoint(name: str, namespace: str, port: int) -> str:
    return f"http://{name}.{namespace}.svc:{port}"


def cache_claim_name(name: str) -> str:
    return f"{name}-model-cache"


def render(body: Mapping[str, Any], config: RenderConfig) -> Manifests:
    """Render a ``PagedLLM`` resource; raise :class:`SpecError` if it cannot be served."""
    meta = body.get("metadata", {})
    name = dns_label("metadata.name", meta.get("name", ""), "the Service")
    spec = PagedLLMSpec.from_dict(body.get("spec"))
    check_engine(spec, model_path(spec))
    generation = meta.get("generation")
    fleet_config = FleetConfig.of(config)
    fleet = render_fleet(name, meta.get("namespace", ""), spec, selector_labels(name), fleet_config)
    for obj in fleet.all():
        obj["metadata"]["labels"] = {**obj["metadata"].get("labels", {}), **labels(name)}
    manifests = Manifests(
        deployment=render_deployment(name, spec, config, generation),
        service=render_service(name, spec),
        pvc=render_pvc(name, spec) if spec.model_cache is not None else None,
        fleet=fleet,
        job=render_download_job(name, spec, _job_pod_spec(name, spec, config), labels(name), download_pod_labels(name))
        if uses_download_job(spec)
        else None,
        network_policies=_network_policies(name, spec, config),
        adapters=render_adapters_config_map(name, spec.adapters, spec.lora_enabled),
    )
    if wants_leaderworkerset(spec):
        manifests = spread_over_nodes(manifests, name, spec)
    _adopt(manifests, body, spec)
    return manifests


def _network_policies(name: str, spec: PagedLLMSpec, config: RenderConfig) -> tuple[dict, ...]:
    if not (config.network_policies and spec.network_policy.enabled):
        return ()
    downloads = download_pod_labels(name) if uses_download_job(spec) else None
    routing = spec.routing
    picker = picker_labels(name) if routing.inference_pool and routing.deploy_picker else None
    namespaces = config.network_policy_namespaces
    pods = server_pod_labels(name)
    policies = render_network_policies(name, spec, pods, downloads, picker, namespaces, config.operator_namespace)
    for policy in policies:
        policy["metadata"]["labels"] = labels(name)
    return policies


def _adopt(manifests: Manifests, body: Mapping[str, Any], spec: PagedLLMSpec) -> None:
    """Owner references on every child except a retained claim, which outlives the resource."""
    owner = as_body(body)
    retained = manifests.pvc if spec.model_cache is not None and spec.model_cache.retain_policy == "Retain" else None
    kopf.adopt([m for m in manifests.all() if m is not retained], owner=owner)
    if retained is not None:
        # NOTE: what adopt does besides the owner reference: the namespace and the owner's labels.
        kopf.adjust_namespace([retained], namespace=body["metadata"].get("namespace"))
        kopf.label([retained], labels=body["metadata"].get("labels") or {})


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
    return spec.rollout_plan.strategy()


def _pod_spec(name: str, spec: PagedLLMSpec, config: RenderConfig) -> dict:
    volumes, mounts = _volumes(name, spec)
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the server never talks to the API
        "enableServiceLinks": False,
        "securityContext": pod_security(),
        # NOTE: longer than the pre-stop pause plus the server's drain timeout, so in-flight requests finish.
        "terminationGracePeriodSeconds": PRESTOP_SLEEP_SECONDS + spec.drain_timeout_seconds + GRACE_MARGIN_SECONDS,
        "containers": [_server_container(name, spec, config, mounts)],
        "volumes": volumes,
    }
    if spec.downloads:
        pod["initContainers"] = [_download_container(name, spec, config, mounts)]
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
        mounts.extend(adapter_mounts(spec.lora_enabled))
    elif spec.downloads:
        source = (
            {"persistentVolumeClaim": {"claimName": cache_claim_name(name)}}
            if spec.model_cache is not None
            else {"emptyDir": {"sizeLimit": models_size_limit(spec)}}
        )
        volumes.append({"name": "models", **source})
        mounts.append({"name": "models", "mountPath": MODELS_DIR})
    if spec.tensor_parallel_size > 1:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gib(spec)}Gi"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    for volume, path in WRITABLE_DIRS:
        volumes.append({"name": volume, "emptyDir": {}})
        mounts.append({"name": volume, "mountPath": path})
    return volumes, mounts


# Writable emptyDirs under the read-only root filesystem: (volume, mount path).
WRITABLE_DIRS = (("tmp", "/tmp"), ("home", HOME_DIR))


def _server_container(name: str, spec: PagedLLMSpec, config: RenderConfig, mounts: list[dict]) -> dict:
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
        "env": server_env(spec) + server_adapter_env(name, spec.lora_enabled),
        "resources": server_resources(spec),
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
        "securityContext": container_security(),
        "volumeMounts": mounts,
    }
    return container


def _download_container(
    name: str, spec: PagedLLMSpec, config: RenderConfig, mounts: list[dict], *, job: bool = False
) -> dict:
    """The pod's init container (fetch-model, or wait-for-model with a Job-filled cache), or the Job's.

    NOTE: the Job is given the Hub adapters as arguments; a pod's container reads them from the
    adapters ConfigMap, so the pod template does not change with the list."""
    waits = uses_download_job(spec) and not job
    container: dict[str, Any] = {
        "name": JOB_CONTAINER if job else WAIT_CONTAINER if waits else FETCH_CONTAINER,
        "image": spec.image or config.default_image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": download_args(spec, wait=waits) + (adapter_download_args(spec.adapters) if job else []),
        "env": hub_env(spec, downloads=not waits) + ([] if job else download_adapter_env(name, spec.lora_enabled)),
        "resources": WAIT_RESOURCES if waits else download_resources(),
        "securityContext": container_security(),
        "volumeMounts": [m for m in mounts if m["name"] in ("models", "tmp", "home")],
    }
    env_from = [] if waits else credentials_env_from(spec)
    return {**container, "envFrom": env_from} if env_from else container


# A wait-for-model container only polls for a file.
WAIT_RESOURCES = {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}


def _job_pod_spec(name: str, spec: PagedLLMSpec, config: RenderConfig) -> dict:
    """The download Job's pod: the cache and scratch volumes, the download container, the pods' placement."""
    volumes, mounts = _volumes(name, spec)
    keep = {"models", "tmp", "home"}
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(),
        "containers": [_download_container(name, spec, config, mounts, job=True)],
        "volumes": [v for v in volumes if v["name"] in keep],
    }
    # NOTE: the server pods' node selector and tolerations: a ReadWriteOnce claim is then
    # attached where the server pods can run, and zonal storage is bound in their zone.
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    if spec.service_account_name:  # a cloud identity (IRSA, Workload Identity) that may read the bucket
        pod["serviceAccountName"] = spec.service_account_name
    return pod
