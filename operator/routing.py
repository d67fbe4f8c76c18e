"""Rendering ``spec.routing``: a Gateway API Inference Extension ``InferencePool``.

The pool names the server pods (by the Service's selector) and their port, and points a
Gateway at the endpoint picker (EPP) that chooses a pod per request from the pods'
queue length, running requests and KV-cache use (and prefix-cache affinity), which it
scrapes from each server's ``/metrics``. The picker itself is deployed by its own
project's chart; the pool only references its Service.

NOTE: ``inference.networking.k8s.io/v1`` is the project's GA API (v1.0, 2025), which its
docs name current; the older ``inference.networking.x-k8s.io/v1alpha2`` pool (with
``targetPortNumber`` and ``extensionRef``) is not rendered.
"""

from __future__ import annotations

from pagedllm.operator.spec import Routing
from pagedllm.operator.spec_fields import dns_label

INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"


def endpoint_picker_name(name: str, routing: Routing) -> str:
    """The picker's Service: as given, else ``NAME-epp``, which a name of over 59 characters makes too long."""
    if routing.endpoint_picker:
        return routing.endpoint_picker
    return dns_label(
        "spec.routing.endpointPicker.name", f"{name}-epp", "the endpoint picker's Service (unset: NAME-epp)"
    )


def render_inference_pool(name: str, selector: dict[str, str], port: int, routing: Routing) -> dict:
    """The pool of the resource ``name``'s pods (``selector``), served on ``port``."""
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": endpoint_picker_name(name, routing),
                "port": {"number": routing.endpoint_picker_port},
                "failureMode": routing.failure_mode,
            },
        },
    }
