"""PagedLLM resources and render settings for the pure rendering and CRD tests, and the
parts of a rendered Deployment they look at."""

from __future__ import annotations

from pagedllm.operator.manifests import RenderConfig

CONFIG = RenderConfig(default_image="registry.example/pagedllm:1")
KEDA = RenderConfig(default_image="img", autoscaler="keda", prometheus_address="http://prom.monitoring.svc:9090")
UID = "6f1c2c1e-0000-4000-8000-000000000001"


def body(name: str = "llama", namespace: str = "ml", generation: int = 3, **spec) -> dict:
    """A PagedLLM as the operator receives it (namespaced, with a uid and a generation)."""
    return {
        "apiVersion": "pagedllm.dev/v1alpha1",
        "kind": "PagedLLM",
        "metadata": {"name": name, "namespace": namespace, "uid": UID, "generation": generation},
        "spec": {"model": "meta-llama/Llama-2-7b-hf", **spec},
    }


def resource(**spec) -> dict:
    """A PagedLLM as a user writes it, for the CRD schema and its CEL rules."""
    return {
        "apiVersion": "pagedllm.dev/v1alpha1",
        "kind": "PagedLLM",
        "metadata": {"name": "llama"},
        "spec": {"model": "org/model", **spec},
    }


def pod(manifests) -> dict:
    return manifests.deployment["spec"]["template"]["spec"]


def server(manifests) -> dict:
    (container,) = pod(manifests)["containers"]
    return container
