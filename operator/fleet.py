"""The objects around a resource's Deployment that make its replicas a fleet.

    PodDisruptionBudget   more than one replica (fixed, or as the autoscaler's maximum)
    autoscaler            spec.autoscaling: HorizontalPodAutoscaler or KEDA ScaledObject
    InferencePool         spec.routing.inferencePool
    endpoint picker       spec.routing.endpointPicker.deploy (with the pool)
    PodMonitor            always rendered; applied only where the Prometheus Operator runs
    HTTPScaledObject      instead of the autoscaler, scaling from zero with KEDA's HTTP add-on
      + NAME-http Service   (autoscaling.minReplicas 0 and --keda-http-interceptor: keda_http.py)

Pure functions, like the rest of the rendering; which of these the cluster can take is
decided when they are applied (:mod:`capabilities`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.operator.autoscaling import KEDA, render_autoscaler
from pagedllm.operator.endpoint_picker import DEFAULT_PICKER_IMAGE, render_endpoint_picker
from pagedllm.operator.keda_http import render_http_scaled_object, render_proxy_service, wants_http_scaling
from pagedllm.operator.monitoring import render_pod_monitor
from pagedllm.operator.routing import render_inference_pool
from pagedllm.operator.spec import PagedLLMSpec


@dataclass(frozen=True)
class FleetConfig:
    """Operator-wide settings of the fleet objects."""

    autoscaler: str
    prometheus_address: str
    pod_monitor_labels: tuple[tuple[str, str], ...] = ()
    endpoint_picker_image: str = DEFAULT_PICKER_IMAGE
    http_interceptor: str | None = None
    """KEDA's HTTP add-on interceptor proxy (SERVICE.NAMESPACE:PORT): minReplicas 0 holds requests there."""

    @classmethod
    def of(cls, config: Any) -> FleetConfig:
        """The fleet's part of a :class:`~pagedllm.operator.manifests.RenderConfig` (the add-on only with KEDA)."""
        interceptor = config.http_interceptor if config.autoscaler == KEDA else None
        labels, image = config.pod_monitor_labels, config.endpoint_picker_image
        return cls(config.autoscaler, config.prometheus_address, labels, image, interceptor)


@dataclass(frozen=True)
class Fleet:
    """The fleet objects of one resource; ``None`` where the spec asks for none."""

    disruption_budget: dict | None
    autoscaler: dict | None
    inference_pool: dict | None
    pod_monitor: dict
    endpoint_picker: tuple[dict, ...] = ()
    """The picker's objects, with spec.routing.endpointPicker.deploy."""
    proxy_service: dict | None = None
    """NAME-http, the interceptor's address for this model, when it scales from zero on the HTTP add-on."""

    def all(self) -> list[dict]:
        return self.of_servers() + list(self.endpoint_picker) + ([self.proxy_service] if self.proxy_service else [])

    def of_servers(self) -> list[dict]:
        """The objects that select or scale the server pods (not the picker's own)."""
        found = (self.disruption_budget, self.autoscaler, self.pod_monitor, self.inference_pool)
        return [m for m in found if m is not None]


def max_replicas(spec: PagedLLMSpec) -> int:
    """The most replicas the resource may run."""
    if spec.autoscaling is not None:
        return spec.autoscaling.max_replicas
    return spec.fixed_replicas or 0


def render_fleet(name: str, namespace: str, spec: PagedLLMSpec, selector: dict[str, str], config: FleetConfig) -> Fleet:
    scaling = spec.autoscaling
    from_zero = wants_http_scaling(spec, config.http_interceptor)
    return Fleet(
        # NOTE: with an autoscaler, whenever it may run 2+ replicas: maxUnavailable 1 never
        # blocks a drain while it runs one, and protects the fleet once it has grown.
        disruption_budget=render_disruption_budget(name, selector) if max_replicas(spec) > 1 else None,
        autoscaler=(
            render_http_scaled_object(name, namespace, spec)
            if from_zero
            else render_autoscaler(name, namespace, scaling, config.autoscaler, config.prometheus_address)
            if scaling is not None
            else None
        ),
        inference_pool=(
            render_inference_pool(name, selector, spec.port, spec.routing) if spec.routing.inference_pool else None
        ),
        pod_monitor=render_pod_monitor(name, selector, "http", dict(config.pod_monitor_labels)),
        endpoint_picker=(
            tuple(render_endpoint_picker(name, namespace, spec.routing, config.endpoint_picker_image))
            if spec.routing.inference_pool and spec.routing.deploy_picker
            else ()
        ),
        proxy_service=render_proxy_service(name, config.http_interceptor or "") if from_zero else None,
    )


def render_disruption_budget(name: str, selector: dict[str, str]) -> dict:
    """At most one server pod down at a time in voluntary disruptions (node drains), with 2+ replicas.
    NOTE: left in place if replicas later drop to 1: maxUnavailable 1 never blocks a drain then."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(selector)}},
    }
