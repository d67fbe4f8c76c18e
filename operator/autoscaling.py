"""Rendering ``spec.autoscaling``: a HorizontalPodAutoscaler, or a KEDA ScaledObject.

Both scale the resource's Deployment (not the ``PagedLLM`` itself, whose ``spec.replicas``
stays unset under autoscaling) on one gauge every server exports::

    metric            Prometheus series                  per-replica target means
    queue             pagedllm:num_requests_waiting      requests waiting for admission
    runningRequests   pagedllm:num_requests_running      sequences being decoded
    kvCache           pagedllm:kv_cache_usage_perc       fraction of KV-cache blocks in use (0-1)

- HPA (``autoscaling/v2``): a ``Pods`` metric of that name from the custom metrics API
  (an adapter such as prometheus-adapter serves it); the HPA averages it over the pods.
- KEDA (``keda.sh/v1alpha1``, the operator started with ``--autoscaler keda``): a
  Prometheus trigger summing the series over the resource's pods, with the target as the
  per-replica ``AverageValue`` threshold, so both compute ceil(sum / target) replicas.
  Only KEDA scales to zero (``minReplicas: 0``).
"""

from __future__ import annotations

from collections.abc import Mapping

from pagedllm.operator.spec import Autoscaling, SpecError

HPA, KEDA = "hpa", "keda"
AUTOSCALERS = (HPA, KEDA)
KEDA_API_VERSION = "keda.sh/v1alpha1"

METRIC_SERIES: Mapping[str, str] = {
    "queue": "pagedllm:num_requests_waiting",
    "runningRequests": "pagedllm:num_requests_running",
    "kvCache": "pagedllm:kv_cache_usage_perc",
}


def render_autoscaler(
    name: str, namespace: str, scaling: Autoscaling, autoscaler: str, prometheus_address: str
) -> dict:
    """The object that scales the Deployment ``name`` as ``scaling`` asks, for the operator's autoscaler."""
    if autoscaler == KEDA:
        return render_scaled_object(name, namespace, scaling, prometheus_address)
    if scaling.min_replicas == 0:
        raise SpecError(
            "spec.autoscaling.minReplicas=0 is not allowed here: scaling to zero needs KEDA (install the "
            "operator with --set autoscaler=keda, i.e. `pagedllm operator --autoscaler keda`); "
            "use minReplicas >= 1 with the HorizontalPodAutoscaler"
        )
    return render_hpa(name, scaling)


def _target_ref(name: str) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}


def quantity(value: float) -> str:
    """A Kubernetes quantity for a target: 4 -> "4", 0.8 -> "800m"."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def render_hpa(name: str, scaling: Autoscaling) -> dict:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name},
        "spec": {
            "scaleTargetRef": _target_ref(name),
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": METRIC_SERIES[scaling.metric]},
                        "target": {"type": "AverageValue", "averageValue": quantity(scaling.target)},
                    },
                }
            ],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": scaling.scale_down_delay_seconds}},
        },
    }


# Pod names are NAME-<template hash, up to 10>-<5 random>, the part before the random
# suffix cut to 58 characters: past this length the pattern below would miss the pods.
MAX_KEDA_NAME = 58 - len("-0123456789-")


def pod_pattern(name: str) -> str:
    """A PromQL regular expression for the pod names of the Deployment ``name`` (NAME-<hash>-<suffix>).

    NOTE: anchored by PromQL, and the two parts hold no '-', so the pods of another
    resource named NAME-something never match.
    """
    return f"{name}-[a-z0-9]+-[a-z0-9]+"


def prometheus_query(name: str, namespace: str, metric: str) -> str:
    """The sum of the metric over the resource's pods, 0 when none exports it (scaled to zero)."""
    return f'sum({METRIC_SERIES[metric]}{{namespace="{namespace}",pod=~"{pod_pattern(name)}"}}) or vector(0)'


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def render_scaled_object(name: str, namespace: str, scaling: Autoscaling, prometheus_address: str) -> dict:
    if len(name) > MAX_KEDA_NAME:
        raise SpecError(
            f"metadata.name={name!r} ({len(name)} characters) is too long for KEDA autoscaling: its Prometheus "
            f"query finds the pods by name, which Kubernetes cuts short past {MAX_KEDA_NAME} characters of the "
            f"resource's name; use a name of at most {MAX_KEDA_NAME}"
        )
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": "ScaledObject",
        "metadata": {"name": name},
        "spec": {
            "scaleTargetRef": _target_ref(name),
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            # Only used to go from 1 to 0 replicas; the window below paces every other step down.
            "cooldownPeriod": scaling.scale_down_delay_seconds,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {"scaleDown": {"stabilizationWindowSeconds": scaling.scale_down_delay_seconds}}
                }
            },
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": prometheus_address,
                        "query": prometheus_query(name, namespace, scaling.metric),
                        "threshold": _number(scaling.target),
                        "activationThreshold": "0",
                    },
                }
            ],
        },
    }
