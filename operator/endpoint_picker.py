"""Rendering the Gateway API Inference Extension's reference endpoint picker for one pool.

``spec.routing.endpointPicker.deploy: true`` makes the operator run the picker itself,
since a pool whose picker does not answer fails closed::

    ServiceAccount, Role, RoleBinding   NAME-epp: read the pool, its pods, InferenceObjectives
    ConfigMap                           NAME-epp: the picker's plugin configuration
    Deployment                          NAME-epp: two pickers (`epp --pool-name NAME ...`), on different
                                        nodes where the scheduler can, with CPU and memory requests
    PodDisruptionBudget                 NAME-epp: a drain takes one picker at a time
    Service                             NAME-epp: its ext_proc gRPC port, which the pool references

The picker reads the servers' queue length, running requests and KV-cache use from their
``/metrics`` (vLLM's names, which the servers export) and scores pods on them and on
prefix-cache affinity.

NOTE: the pickers run active-active, without the picker's leader election: each scrapes every
server and picks on its own, and the Service spreads the gateway's calls over both. With one
leader only one picker would be ready, so a budget could never let a drain evict it, and a
lost leader would leave no ready picker until another is elected. The price: each picker's
prefix-cache index learns only from the requests it routed, so prefix affinity is looser.
A gateway whose picker does not answer follows spec.routing.failureMode (FailClose by default).
"""

from __future__ import annotations

from pagedllm.operator.fleet_spec import Routing
from pagedllm.operator.routing import INFERENCE_POOL_API_VERSION, endpoint_picker_name

# The project's reference picker; operator flag --endpoint-picker-image, spec.routing.endpointPicker.image.
DEFAULT_PICKER_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.0.1"
HEALTH_PORT = 9003  # the picker's gRPC health service
METRICS_PORT = 9090
REPLICAS = 2
# NOTE: no CPU limit: a throttled picker delays every request routed through the gateway.
RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
HOSTNAME = "kubernetes.io/hostname"
CONFIG_FILE = "plugins.yaml"
CONFIG_DIR = "/config"

# NOTE: its own schema (EndpointPickerConfig): score every pod on each signal and pick the best.
PLUGINS_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: queue-scorer
  - type: kv-cache-utilization-scorer
  - type: prefix-cache-scorer
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: queue-scorer
        weight: 2
      - pluginRef: kv-cache-utilization-scorer
        weight: 2
      - pluginRef: prefix-cache-scorer
        weight: 3
"""


def picker_labels(name: str) -> dict[str, str]:
    """The picker pods' labels: never the servers' selector (the pool must not select the picker)."""
    return {"app.kubernetes.io/name": "pagedllm-endpoint-picker", "app.kubernetes.io/instance": name}


def render_endpoint_picker(name: str, namespace: str, routing: Routing, default_image: str) -> list[dict]:
    """The picker of the pool ``name`` in ``namespace``; all objects are named as its Service."""
    picker = endpoint_picker_name(name, routing)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": picker}},
        _role(picker),
        _role_binding(picker),
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": picker}, "data": {CONFIG_FILE: PLUGINS_CONFIG}},
        _deployment(picker, name, namespace, routing, routing.picker_image or default_image),
        _disruption_budget(picker, name),
        _service(picker, name, routing.endpoint_picker_port),
    ]


def _role(picker: str) -> dict:
    read = ["get", "list", "watch"]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": picker},
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": read},
            {"apiGroups": [INFERENCE_POOL_API_VERSION.split("/")[0]], "resources": ["inferencepools"], "verbs": read},
            {
                "apiGroups": ["inference.networking.x-k8s.io"],
                "resources": ["inferenceobjectives", "inferencemodelrewrites"],
                "verbs": read,
            },
        ],
    }


def _role_binding(picker: str) -> dict:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": picker},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": picker},
        "subjects": [{"kind": "ServiceAccount", "name": picker}],
    }


def _deployment(picker: str, name: str, namespace: str, routing: Routing, image: str) -> dict:
    grpc_health = {"port": HEALTH_PORT, "service": "inference-extension"}
    container = {
        "name": "epp",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": [
            "--pool-name",
            name,
            "--pool-namespace",
            namespace,
            "--config-file",
            f"{CONFIG_DIR}/{CONFIG_FILE}",
            "--grpc-port",
            str(routing.endpoint_picker_port),
            "--grpc-health-port",
            str(HEALTH_PORT),
            "--metrics-port",
            str(METRICS_PORT),
        ],  # fmt: skip
        "ports": [
            {"name": "grpc", "containerPort": routing.endpoint_picker_port, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "resources": {part: dict(amounts) for part, amounts in RESOURCES.items()},
        "readinessProbe": {"grpc": grpc_health, "periodSeconds": 5},
        "livenessProbe": {"grpc": grpc_health, "periodSeconds": 10, "initialDelaySeconds": 5},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": picker},
        "spec": {
            "replicas": REPLICAS,
            "selector": {"matchLabels": picker_labels(name)},
            # NOTE: a new picker is ready before an old one goes: never fewer than REPLICAS answer.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": picker_labels(name)},
                "spec": {
                    "serviceAccountName": picker,
                    "affinity": _spread(name),
                    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    "volumes": [{"name": "config", "configMap": {"name": picker}}],
                },
            },
        },
    }


def _spread(name: str) -> dict:
    """Prefer nodes without another picker of this pool: one node's loss leaves the other."""
    term = {"labelSelector": {"matchLabels": picker_labels(name)}, "topologyKey": HOSTNAME}
    # NOTE: preferred, not required: a one-node cluster still runs both.
    preferred = [{"weight": 100, "podAffinityTerm": term}]
    return {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": preferred}}


def _disruption_budget(picker: str, name: str) -> dict:
    """A drain evicts one picker at a time; the other keeps answering the gateway."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": picker},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": picker_labels(name)}},
    }


def _service(picker: str, name: str, port: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": picker},
        "spec": {
            "selector": picker_labels(name),
            "ports": [
                {"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "http2"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }
