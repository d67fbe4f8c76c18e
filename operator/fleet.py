"""The objects around a resource's Deployment that make its replicas a fleet.

    PodDisruptionBudget   more than one replica (fixed, or as the autoscaler's maximum)
    autoscaler            spec.autoscaling: HorizontalPodAutoscaler or KEDA ScaledObject
    InferencePool         spec.routing.inferencePool
    endpoint picker       spec.routing.endpointPicker.deploy (with the pool)
    PodMonitor            always rendered; applied only where the Prometheus Operator runs

Pure functions, like the rest of the rendering; which of these the cluster can take is
decided when they are applied (:mod:`capabilities`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.operator.autoscaling import render_autoscaler
from pagedllm.operator.endpoint_picker import DEFAULT_PICKER_IMAGE, render_endpoint_picker
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


@dataclass(frozen=True)
class Fleet:
    """The fleet objects of one resource; ``None`` where the spec asks for none."""

    disruption_budget: dict | None
    autoscaler: dict | None
    inference_pool: dict | None
    pod_monitor: dict
    endpoint_picker: tuple[dict, ...] = ()
    """The picker's objects, with spec.routing.endpointPicker.deploy."""

    def all(self) -> list[dict]:
        return self.of_servers() + list(self.endpoint_picker)

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
    return Fleet(
        # NOTE: with an autoscaler, whenever it may run 2+ replicas: maxUnavailable 1 never
        # blocks a drain while it runs one, and protects the fleet once it has grown.
        disruption_budget=render_disruption_budget(name, selector) if max_replicas(spec) > 1 else None,
        autoscaler=(
            render_autoscaler(name, namespace, scaling, config.autoscaler, config.prometheus_address)
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
