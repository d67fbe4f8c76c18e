"""The labels of what the operator renders: who manages it, which resource it belongs to, which part it is.

NOTE: ``selector_labels`` is a Deployment's immutable selector: changing it would orphan
every running pod, so it names only the app and the instance.
"""

from __future__ import annotations

MANAGED_BY = "pagedllm-operator"


def labels(name: str) -> dict[str, str]:
    """Labels of everything rendered for the resource ``name``."""
    return {
        **selector_labels(name),
        "app.kubernetes.io/component": "server",
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


INSTANCE_LABEL = "app.kubernetes.io/instance"


def server_pod_labels(name: str) -> dict[str, str]:
    """What tells a server pod from the resource's other pods (the download Job's, the picker's)."""
    return {**selector_labels(name), "app.kubernetes.io/component": "server"}


def download_pod_labels(name: str) -> dict[str, str]:
    """The download Job's pods: outside every server selector (Service, budget, pool, policies)."""
    return {
        **labels(name),
        "app.kubernetes.io/name": "pagedllm-model-download",
        "app.kubernetes.io/component": "model-download",
    }


def selector_labels(name: str) -> dict[str, str]:
    """The Deployment's (immutable) selector and the Service's selector."""
    return {"app.kubernetes.io/name": "pagedllm", INSTANCE_LABEL: name}


def selector_string(name: str) -> str:
    """:func:`selector_labels` in the serialized form of status.selector (for HPAs)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())
