"""The ``PagedLLM`` spec as a typed, validated object.

The CRD (``crds/pagedllm.yaml``) is the source of truth for defaults and bounds; every
scalar field below carries the same default, enum and range in its metadata, and
``test_operator_spec_mirrors_the_schema`` in ``tests/operator/test_crd.py`` checks the
two agree (``tests/operator/test_crd_scalars.py``: both accept the same values). Parsing
here is the operator's second line of defence: a spec that slipped past the schema (an
old CRD, a cluster without CEL) is refused with a :class:`SpecError` naming the field,
the value and what is allowed, and the handlers turn that into a ``Degraded`` condition.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedllm.operator.adapters import Adapter, check_adapter_sources, check_lora_switch, parse_adapters
from pagedllm.operator.fleet_spec import Autoscaling, Routing, parse_autoscaling, parse_routing
from pagedllm.operator.group_placement import GroupPlacement, parse_group_placement
from pagedllm.operator.model_source import (  # noqa: F401 (the model source's names are imported from here too)
    ACCESS_MODES,
    MODEL_SOURCES,
    ModelCache,
    ModelSource,
    PvcModelSource,
    parse_model_cache,
    parse_model_source,
)
from pagedllm.operator.network_policy import NetworkPolicySettings, parse_network_policy
from pagedllm.operator.rollout import Rollout, RolloutPlan, parse_rollout, plan_rollout
from pagedllm.operator.spec_fields import (  # noqa: F401 (SpecError and GPU_RESOURCE are imported from here)
    GPU_RESOURCE,
    SpecError,
    _dns_subdomain,
    _env,
    _mapping,
    _name_refs,
    _object_list,
    _plain_object,
    _quantity,
    _resources,
    _spread_constraints,
    _string_list,
    _string_map,
)

TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)
MAX_LORA_RANKS = (1, 8, 16, 32, 64)
BLOCK_SIZES = (8, 16, 32, 64, 128)
DTYPES = ("auto", "float16", "bfloat16", "float32")
PREEMPTION_MODES = ("recompute", "swap")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
QUANTIZATIONS = ("awq", "gptq", "compressed-tensors", "fp8", "int8")
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
PUBLIC_SERVICE_TYPES = ("NodePort", "LoadBalancer")
LOG_LEVELS = ("debug", "info", "warning", "error")
ROLLOUT_STRATEGIES = ("Recreate", "RollingUpdate")
# An extended resource a device plugin advertises: vendor domain / name, e.g.
# nvidia.com/gpu, nvidia.com/mig-1g.10gb (MIG slices), amd.com/gpu, gpu.intel.com/i915.
GPU_RESOURCE_PATTERN = (
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+/[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$"
)
GPU_RESOURCE_RE = re.compile(GPU_RESOURCE_PATTERN)
# Labels the operator sets on every server pod (its selectors): spec.podLabels cannot change them.
RESERVED_POD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
)

_MODEL_RE = re.compile(r"^[A-Za-z0-9_./-]+$")


@dataclass(frozen=True)
class SecretKeyRef:
    """One key of a Secret in the resource's namespace."""

    name: str
    key: str


def _scalar(key: str, kind: type, *, choices: tuple = (), minimum=None, maximum=None) -> dict:
    return {"key": key, "kind": kind, "choices": choices, "minimum": minimum, "maximum": maximum}


def _nested(key: str, parse: Callable[[str, Any], Any]) -> dict:
    return {"key": key, "parse": parse}


def _check_scalar(meta: Mapping[str, Any], value: Any) -> Any:
    path, kind = f"spec.{meta['key']}", meta["kind"]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise SpecError(f"{path}={value!r} has the wrong type: must be {kind.__name__}")
    if meta["choices"] and value not in meta["choices"]:
        raise SpecError(f"{path}={value!r} is not allowed: choose one of {list(meta['choices'])}")
    low, high = meta["minimum"], meta["maximum"]
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = " and ".join(
            b for b in (f">= {low}" if low is not None else "", f"<= {high}" if high is not None else "") if b
        )
        raise SpecError(f"{path}={value!r} is out of range: must be {bounds}")
    if kind is str and not value:
        raise SpecError(f"{path}='' is not allowed: must not be empty")
    return value


def _secret_ref(default_key: str) -> Callable[[str, Any], SecretKeyRef]:
    def parse(path: str, value: Any) -> SecretKeyRef:
        value = _mapping(path, value)
        name, key = value.get("name"), value.get("key", default_key)
        for sub, item in (("name", name), ("key", key)):
            if not isinstance(item, str) or not item:
                raise SpecError(f"{path}.{sub}={item!r} is not allowed: must be a non-empty string")
        return SecretKeyRef(name=name, key=key)

    return parse


@dataclass(frozen=True)
class PagedLLMSpec:
    """The desired model server; one field per CRD spec key (``block_size`` <- ``blockSize``)."""

    model: str = field(metadata=_scalar("model", str))
    model_source: ModelSource = field(default_factory=ModelSource, metadata=_nested("modelSource", parse_model_source))
    hf_token_secret: SecretKeyRef | None = field(default=None, metadata=_nested("hfTokenSecret", _secret_ref("token")))
    # NOTE: no default in the CRD either: unset means 1, and it must stay unset with autoscaling.
    replicas: int | None = field(default=None, metadata=_scalar("replicas", int, minimum=0))
    autoscaling: Autoscaling | None = field(default=None, metadata=_nested("autoscaling", parse_autoscaling))
    routing: Routing = field(default_factory=Routing, metadata=_nested("routing", parse_routing))
    tensor_parallel_size: int = field(
        default=1, metadata=_scalar("tensorParallelSize", int, choices=TENSOR_PARALLEL_SIZES)
    )
    nodes: int = field(default=1, metadata=_scalar("nodes", int, minimum=1, maximum=64))
    """Pods per replica: above 1 the replica's tensorParallelSize x nodes ranks span nodes (a LeaderWorkerSet)."""
    group_placement: GroupPlacement = field(
        default_factory=GroupPlacement, metadata=_nested("groupPlacement", parse_group_placement)
    )
    block_size: int = field(default=16, metadata=_scalar("blockSize", int, choices=BLOCK_SIZES))
    gpu_memory_utilization: float = field(
        default=0.9, metadata=_scalar("gpuMemoryUtilization", float, minimum=0.1, maximum=0.99)
    )
    max_num_seqs: int = field(default=256, metadata=_scalar("maxNumSeqs", int, minimum=1, maximum=65536))
    max_num_batched_tokens: int | None = field(
        default=None, metadata=_scalar("maxNumBatchedTokens", int, minimum=1, maximum=1048576)
    )
    max_model_len: int | None = field(default=None, metadata=_scalar("maxModelLen", int, minimum=1, maximum=10485760))
    swap_space_gib: float = field(default=4.0, metadata=_scalar("swapSpaceGiB", float, minimum=0, maximum=1024))
    dtype: str = field(default="auto", metadata=_scalar("dtype", str, choices=DTYPES))
    enable_prefix_caching: bool = field(default=True, metadata=_scalar("enablePrefixCaching", bool))
    kv_cache_dtype: str = field(default="auto", metadata=_scalar("kvCacheDtype", str, choices=KV_CACHE_DTYPES))
    quantization: str | None = field(default=None, metadata=_scalar("quantization", str, choices=QUANTIZATIONS))
    preemption_mode: str | None = field(default=None, metadata=_scalar("preemptionMode", str, choices=PREEMPTION_MODES))
    seed: int = field(default=0, metadata=_scalar("seed", int, minimum=0))
    load_format: str = field(default="auto", metadata=_scalar("loadFormat", str, choices=LOAD_FORMATS))
    speculative_config: Mapping[str, Any] | None = field(
        default=None, metadata=_nested("speculativeConfig", lambda path, value: dict(_mapping(path, value)))
    )
    served_model_name: str | None = field(default=None, metadata=_scalar("servedModelName", str))
    api_key_secret: SecretKeyRef | None = field(default=None, metadata=_nested("apiKeySecret", _secret_ref("api-key")))
    image: str | None = field(default=None, metadata=_scalar("image", str))
    image_pull_policy: str = field(
        default="IfNotPresent", metadata=_scalar("imagePullPolicy", str, choices=PULL_POLICIES)
    )
    resources: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, metadata=_nested("resources", _resources))
    node_selector: Mapping[str, str] = field(default_factory=dict, metadata=_nested("nodeSelector", _string_map))
    tolerations: tuple = field(default=(), metadata=_nested("tolerations", _object_list))
    affinity: Mapping[str, Any] | None = field(default=None, metadata=_nested("affinity", _plain_object))
    gpu_resource_name: str = field(default=GPU_RESOURCE, metadata=_scalar("gpuResourceName", str))
    image_pull_secrets: tuple[str, ...] = field(default=(), metadata=_nested("imagePullSecrets", _name_refs))
    pod_annotations: Mapping[str, str] = field(default_factory=dict, metadata=_nested("podAnnotations", _string_map))
    pod_labels: Mapping[str, str] = field(default_factory=dict, metadata=_nested("podLabels", _string_map))
    priority_class_name: str | None = field(default=None, metadata=_nested("priorityClassName", _dns_subdomain))
    runtime_class_name: str | None = field(default=None, metadata=_nested("runtimeClassName", _dns_subdomain))
    service_account_name: str | None = field(default=None, metadata=_nested("serviceAccountName", _dns_subdomain))
    topology_spread_constraints: tuple = field(
        default=(), metadata=_nested("topologySpreadConstraints", _spread_constraints)
    )
    env: tuple = field(default=(), metadata=_nested("env", _env))
    extra_args: tuple[str, ...] = field(default=(), metadata=_nested("extraArgs", _string_list))
    adapters: tuple[Adapter, ...] = field(default=(), metadata=_nested("adapters", parse_adapters))
    enable_lora: bool | None = field(default=None, metadata=_scalar("enableLora", bool))
    """LoRA on (unset: on exactly when adapters are listed)."""
    max_loras: int | None = field(default=None, metadata=_scalar("maxLoras", int, minimum=1, maximum=256))
    max_lora_rank: int | None = field(default=None, metadata=_scalar("maxLoraRank", int, choices=MAX_LORA_RANKS))
    port: int = field(default=8000, metadata=_scalar("port", int, minimum=1024, maximum=65535))
    service_type: str = field(default="ClusterIP", metadata=_scalar("serviceType", str, choices=SERVICE_TYPES))
    allow_unauthenticated_public_service: bool = field(
        default=False, metadata=_scalar("allowUnauthenticatedPublicService", bool)
    )
    """Serve a NodePort or LoadBalancer Service without apiKeySecret, on purpose (refused otherwise)."""
    model_cache: ModelCache | None = field(default=None, metadata=_nested("modelCache", parse_model_cache))
    network_policy: NetworkPolicySettings = field(
        default_factory=NetworkPolicySettings, metadata=_nested("networkPolicy", parse_network_policy)
    )
    startup_timeout_seconds: int = field(
        default=1800, metadata=_scalar("startupTimeoutSeconds", int, minimum=60, maximum=86400)
    )
    drain_timeout_seconds: int = field(
        default=30, metadata=_scalar("drainTimeoutSeconds", int, minimum=0, maximum=3600)
    )
    max_queue_len: int | None = field(default=None, metadata=_scalar("maxQueueLen", int, minimum=1, maximum=1048576))
    log_level: str = field(default="info", metadata=_scalar("logLevel", str, choices=LOG_LEVELS))
    # NOTE: no default in the CRD either: unset means Recreate for one replica, RollingUpdate for a fleet.
    rollout_strategy: str | None = field(
        default=None, metadata=_scalar("rolloutStrategy", str, choices=ROLLOUT_STRATEGIES)
    )
    rollout: Rollout | None = field(default=None, metadata=_nested("rollout", parse_rollout))

    @property
    def fixed_replicas(self) -> int | None:
        """The replica count the Deployment is given; ``None`` when an autoscaler owns it."""
        if self.autoscaling is not None:
            return None
        return 1 if self.replicas is None else self.replicas

    @property
    def is_fleet(self) -> bool:
        """More than one replica, or an autoscaler that may run more."""
        return self.autoscaling is not None or (self.fixed_replicas or 0) > 1

    @property
    def rollout_plan(self) -> RolloutPlan:
        """The Deployment's strategy (raises :class:`SpecError` for a refused combination)."""
        cache = self.model_cache
        rwo_cache = self.downloads and cache is not None and cache.access_mode == "ReadWriteOnce"
        return plan_rollout(self.rollout_strategy, self.rollout, self.is_fleet, rwo_cache)

    @property
    def lora_enabled(self) -> bool:
        """The server runs with ``--enable-lora``: asked for, or adapters listed."""
        return bool(self.adapters) if self.enable_lora is None else self.enable_lora

    @property
    def model_is_path(self) -> bool:
        """``model`` names a directory already in the image rather than a Hub id."""
        return self.model.startswith("/")

    @property
    def uses_pvc_source(self) -> bool:
        return self.model_source.type == "pvc"

    @property
    def downloads(self) -> bool:
        """Whether the model is fetched (Hub or object store) before the server starts."""
        if self.uses_pvc_source:
            return False
        return self.model_source.uri is not None or not self.model_is_path

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any] | None) -> PagedLLMSpec:
        """Parse a resource's ``spec``; raise :class:`SpecError` on the first problem found."""
        spec = _mapping("spec", spec if spec is not None else {})
        known = {f.metadata["key"]: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - set(known))
        if unknown:
            raise SpecError(f"spec has unknown field(s) {unknown}: allowed are {sorted(known)}")
        if spec.get("model") is None:
            raise SpecError("spec.model is required: a Hugging Face model id or an absolute path")
        values = {}
        for key, f in known.items():
            if spec.get(key) is None:
                continue
            meta = f.metadata
            path = f"spec.{key}"
            values[f.name] = meta["parse"](path, spec[key]) if "parse" in meta else _check_scalar(meta, spec[key])
        parsed = cls(**values)
        parsed._check_cross_field()
        return parsed

    def _check_cross_field(self) -> None:
        # NOTE: these mirror the CRD's x-kubernetes-validations (CEL) rules.
        if not _MODEL_RE.match(self.model) or ".." in self.model:
            raise SpecError(f"spec.model={self.model!r} is not allowed: letters, digits and _ . / - only, no '..'")
        if self.replicas is not None and self.autoscaling is not None:
            raise SpecError(
                f"spec.replicas={self.replicas} is not allowed with spec.autoscaling: the autoscaler sets the "
                "replicas between autoscaling.minReplicas and maxReplicas; remove spec.replicas"
            )
        if self.model_cache is not None and self.uses_pvc_source:
            raise SpecError("spec.modelCache caches Hugging Face downloads: remove it when modelSource.type is pvc")
        self._check_public_service()
        self._check_pod_fields()
        self.rollout_plan  # noqa: B018 (refuses what cannot roll out)
        check_adapter_sources(self.adapters, not self.uses_pvc_source and not self.model_is_path, self.uses_pvc_source)
        check_lora_switch(self.enable_lora, self.adapters, (self.max_loras, self.max_lora_rank))
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise SpecError(
                f"spec.maxNumBatchedTokens={self.max_num_batched_tokens} is out of range: "
                f"must be >= maxNumSeqs ({self.max_num_seqs})"
            )

    @property
    def is_public(self) -> bool:
        """The Service is reachable from outside the cluster (a node port, a load balancer)."""
        return self.service_type in PUBLIC_SERVICE_TYPES

    def _check_public_service(self) -> None:
        # NOTE: a public Service without a key serves the model to anyone who finds the address.
        if self.is_public and self.api_key_secret is None and not self.allow_unauthenticated_public_service:
            raise SpecError(
                f"spec.serviceType={self.service_type!r} is not allowed without spec.apiKeySecret: the Service is "
                "reachable from outside the cluster and the server would answer anyone; set apiKeySecret, use "
                "serviceType 'ClusterIP', or set allowUnauthenticatedPublicService: true to serve it without a key"
            )

    def _check_pod_fields(self) -> None:
        # NOTE: these mirror the CRD's pattern and x-kubernetes-validations (CEL) rules too.
        name = self.gpu_resource_name
        if len(name) > 253 or not GPU_RESOURCE_RE.match(name) or name.split("/")[0].endswith("kubernetes.io"):
            raise SpecError(
                f"spec.gpuResourceName={name!r} is not allowed: an extended resource of a device plugin, "
                "e.g. nvidia.com/gpu, nvidia.com/mig-1g.10gb or amd.com/gpu"
            )
        for part, amounts in self.resources.items():
            if name in amounts:
                raise SpecError(
                    f"spec.resources.{part}[{name!r}]={amounts[name]!r} is not allowed: "
                    "GPUs come from tensorParallelSize"
                )
        reserved = sorted(set(self.pod_labels) & set(RESERVED_POD_LABELS))
        if reserved:
            raise SpecError(f"spec.podLabels{reserved} is not allowed: the operator sets these labels (its selectors)")
        cache = self.model_cache
        most = self.autoscaling.max_replicas if self.autoscaling is not None else self.fixed_replicas or 0
        if cache is not None and cache.access_mode == "ReadWriteOnce" and most > 1:
            where = f"spec.autoscaling.maxReplicas={most}" if self.autoscaling is not None else f"spec.replicas={most}"
            raise SpecError(
                f"spec.modelCache.accessMode='ReadWriteOnce' is not allowed with {where}: "
                "one claim cannot be mounted by pods on several nodes; use ReadWriteMany, or no modelCache "
                "(each pod downloads into its own emptyDir)"
            )
