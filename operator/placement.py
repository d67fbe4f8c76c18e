"""Where the server pods run and how the cluster treats them: pull secrets, priority and runtime
class, service account, spreading, extra labels and annotations."""

from __future__ import annotations

from typing import Any

from pagedllm.operator.spec import PagedLLMSpec


def pod_metadata(spec: PagedLLMSpec, labels: dict[str, str]) -> dict:
    """The pod template's labels (the operator's win over spec.podLabels) and annotations."""
    metadata: dict[str, Any] = {"labels": {**spec.pod_labels, **labels}}
    if spec.pod_annotations:
        metadata["annotations"] = dict(spec.pod_annotations)
    return metadata


def pod_placement(spec: PagedLLMSpec, selector: dict[str, str]) -> dict:
    """Optional pod fields of the spec: pull secrets, priority, runtime class, identity, spreading."""
    pod: dict[str, Any] = {}
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": secret} for secret in spec.image_pull_secrets]
    if spec.priority_class_name:
        pod["priorityClassName"] = spec.priority_class_name
    if spec.runtime_class_name:
        pod["runtimeClassName"] = spec.runtime_class_name
    if spec.service_account_name:
        # NOTE: the token stays unmounted (automountServiceAccountToken): the account is for the
        # node's or cloud's identity (image pulls, workload identity), not for the API.
        pod["serviceAccountName"] = spec.service_account_name
    if spec.topology_spread_constraints:
        # Without a labelSelector a constraint would count no pods: default to this resource's pods.
        pod["topologySpreadConstraints"] = [
            {"labelSelector": {"matchLabels": selector}, **c} for c in spec.topology_spread_constraints
        ]
    return pod
