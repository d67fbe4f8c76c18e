"""The fleet part of a ``PagedLLM`` spec: ``spec.autoscaling`` and ``spec.routing``.

Parsed like the rest of the spec (:mod:`spec`): every refusal is a :class:`SpecError`
naming the field, the value and what is allowed; the CRD's schema and CEL rules say the
same (a test keeps them agreeing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.operator.spec_fields import SpecError, dns_label

AUTOSCALING_METRICS = ("queue", "kvCache", "runningRequests")
FAILURE_MODES = ("FailClose", "FailOpen")
EPP_PORT = 9002  # the endpoint picker's gRPC (ext_proc) port, its project's default


@dataclass(frozen=True)
class Autoscaling:
    """Replicas that follow the servers' load, between ``min_replicas`` and ``max_replicas``."""

    max_replicas: int
    """Most replicas the autoscaler may run."""
    target: float
    """Load per replica to hold: waiting or running requests, or the KV-cache fraction in use (0-1)."""
    min_replicas: int = 1
    """Fewest replicas; 0 (scale to zero) needs the operator's KEDA autoscaler."""
    metric: str = "queue"
    """queue (requests waiting), kvCache (fraction of KV blocks in use) or runningRequests."""
    scale_down_delay_seconds: int = 300
    """How long the load must stay low before replicas are removed."""


@dataclass(frozen=True)
class Routing:
    """Load- and prefix-aware routing across replicas by a Gateway API Inference Extension endpoint picker."""

    inference_pool: bool = False
    """Create an InferencePool selecting the server pods."""
    endpoint_picker: str | None = None
    """Service of the endpoint picker; unset means NAME-epp."""
    endpoint_picker_port: int = EPP_PORT
    """Port of that Service."""
    failure_mode: str = "FailClose"
    """What the gateway does when the picker does not answer: drop (FailClose) or route anyway (FailOpen)."""
    deploy_picker: bool = False
    """Run the reference endpoint picker for the pool (Deployment, Service, RBAC, config) too."""
    picker_image: str | None = None
    """Image of that picker; unset: the operator's --endpoint-picker-image."""


def _mapping(path: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SpecError(f"{path}={value!r} has the wrong type: must be an object")
    return value


def _int_field(path: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{path}={value!r} has the wrong type: must be an integer")
    if not low <= value <= high:
        raise SpecError(f"{path}={value!r} is out of range: must be >= {low} and <= {high}")
    return value


def _choice(path: str, value: Any, choices: tuple) -> Any:
    if value not in choices:
        raise SpecError(f"{path}={value!r} is not allowed: choose one of {list(choices)}")
    return value


def parse_autoscaling(path: str, value: Any) -> Autoscaling:
    value = _mapping(path, value)
    unknown = sorted(set(value) - {"minReplicas", "maxReplicas", "metric", "target", "scaleDownDelaySeconds"})
    if unknown:
        raise SpecError(f"{path} has unknown field(s) {unknown}")
    for required in ("maxReplicas", "target"):
        if value.get(required) is None:
            raise SpecError(f"{path}.{required} is required")
    metric = _choice(f"{path}.metric", value.get("metric", "queue"), AUTOSCALING_METRICS)
    target = value["target"]
    if isinstance(target, bool) or not isinstance(target, (int, float)) or target <= 0:
        raise SpecError(f"{path}.target={target!r} is not allowed: must be a number > 0")
    if metric == "kvCache" and target > 1:
        raise SpecError(f"{path}.target={target!r} is out of range: the kvCache metric is a fraction, so <= 1")
    scaling = Autoscaling(
        max_replicas=_int_field(f"{path}.maxReplicas", value["maxReplicas"], 1, 1000),
        min_replicas=_int_field(f"{path}.minReplicas", value.get("minReplicas", 1), 0, 1000),
        metric=metric,
        target=float(target),
        scale_down_delay_seconds=_int_field(
            f"{path}.scaleDownDelaySeconds", value.get("scaleDownDelaySeconds", 300), 0, 3600
        ),
    )
    if scaling.min_replicas > scaling.max_replicas:
        raise SpecError(
            f"{path}.minReplicas={scaling.min_replicas} is out of range: "
            f"must be <= maxReplicas ({scaling.max_replicas})"
        )
    return scaling


def parse_routing(path: str, value: Any) -> Routing:
    value = _mapping(path, value)
    unknown = sorted(set(value) - {"inferencePool", "endpointPicker", "failureMode"})
    if unknown:
        raise SpecError(f"{path} has unknown field(s) {unknown}")
    enabled = value.get("inferencePool", False)
    if not isinstance(enabled, bool):
        raise SpecError(f"{path}.inferencePool={enabled!r} has the wrong type: must be a boolean")
    picker = _mapping(f"{path}.endpointPicker", value.get("endpointPicker", {}))
    unknown = sorted(set(picker) - {"name", "port", "deploy", "image"})
    if unknown:
        raise SpecError(f"{path}.endpointPicker has unknown field(s) {unknown}")
    name = picker.get("name")
    if name is not None:
        dns_label(f"{path}.endpointPicker.name", name, "the endpoint picker's Service")
    deploy, image = picker.get("deploy", False), picker.get("image")
    if not isinstance(deploy, bool):
        raise SpecError(f"{path}.endpointPicker.deploy={deploy!r} has the wrong type: must be a boolean")
    if image is not None and (not isinstance(image, str) or not image):
        raise SpecError(f"{path}.endpointPicker.image={image!r} is not allowed: must be a non-empty string")
    return Routing(
        inference_pool=enabled,
        endpoint_picker=name,
        endpoint_picker_port=_int_field(f"{path}.endpointPicker.port", picker.get("port", EPP_PORT), 1, 65535),
        failure_mode=_choice(f"{path}.failureMode", value.get("failureMode", "FailClose"), FAILURE_MODES),
        deploy_picker=deploy,
        picker_image=image,
    )
