"""Rendering the Gateway API Inference Extension's reference endpoint picker for one pool.

``spec.routing.endpointPicker.deploy: true`` makes the operator run the picker itself,
since a pool whose picker does not answer fails closed::

    ServiceAccount, Role, RoleBinding   NAME-epp: read the pool, its pods, InferenceObjectives
    ConfigMap                           NAME-epp: the picker's plugin configuration
    Deployment                          NAME-epp: one picker (`epp --pool-name NAME ...`)
    Service                             NAME-epp: its ext_proc gRPC port, which the pool references

The picker reads the servers' queue length, running requests and KV-cache use from their
``/metrics`` (vLLM's names, which the servers export) and scores pods on them and on
prefix-cache affinity. One replica: several pickers need the picker's own leader election.
"""

from __future__ import annotations

from pagedllm.operator.fleet_spec import Routing
from pagedllm.operator.routing import INFERENCE_POOL_API_VERSION, endpoint_picker_name

# The project's reference picker; operator flag --endpoint-picker-image, spec.routing.endpointPicker.image.
DEFAULT_PICKER_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.0.1"
HEALTH_PORT = 9003  # the picker's gRPC health service
METRICS_PORT = 9090
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
            "replicas": 1,
            "selector": {"matchLabels": picker_labels(name)},
            "template": {
                "metadata": {"labels": picker_labels(name)},
                "spec": {
                    "serviceAccountName": picker,
                    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    "volumes": [{"name": "config", "configMap": {"name": picker}}],
                },
            },
        },
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
