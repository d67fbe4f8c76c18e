"""Where the server pods run and how the cluster treats them: pull secrets, priority, runtime
class, service account, spreading, extra labels and annotations, and the disruption budget."""

from __future__ import annotations

from typing import Any

from pagedllm.operator.spec import PagedLLMSpec


def disruption_budget(name: str, labels: dict[str, str], selector: dict[str, str]) -> dict:
    """At most one server pod down at a time in voluntary disruptions (node drains), with 2+ replicas.
    NOTE: left in place if replicas later drop to 1: maxUnavailable 1 never blocks a drain then."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "labels": labels},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
    }


def pod_metadata(spec: PagedLLMSpec, labels: dict[str, str]) -> dict:
    """The pod template's metadata: the user's labels and annotations, the operator's labels winning."""
    metadata: dict[str, Any] = {"labels": {**spec.pod_labels, **labels}}
    if spec.pod_annotations:
        metadata["annotations"] = dict(spec.pod_annotations)
    return metadata


def add_cluster_fields(pod: dict, spec: PagedLLMSpec) -> None:
    """What some clusters need of a pod: pull secrets, priority, runtime class, an account, spreading."""
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": secret} for secret in spec.image_pull_secrets]
    for key, value in (
        ("priorityClassName", spec.priority_class_name),
        ("runtimeClassName", spec.runtime_class_name),
        ("serviceAccountName", spec.service_account_name),
    ):
        if value is not None:
            pod[key] = value
    if spec.topology_spread_constraints:
        pod["topologySpreadConstraints"] = [dict(c) for c in spec.topology_spread_constraints]
