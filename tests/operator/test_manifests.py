"""Rendering a PagedLLM into its Deployment, Service and claim (pure functions)."""

from __future__ import annotations

import math

import pytest
from resource_factories import CONFIG, UID, body, pod, server
from third_party_schemas import validate_manifest

from pagedllm.operator.command import API_KEY_ENV, SERVE_COMMAND
from pagedllm.operator.manifests import (
    GENERATION_ANNOTATION,
    GRACE_MARGIN_SECONDS,
    PRESTOP_SLEEP_SECONDS,
    RUN_AS,
    labels,
    render,
    selector_labels,
)
from pagedllm.operator.spec import SpecError


def volume_names(manifests) -> set[str]:
    return {v["name"] for v in pod(manifests)["volumes"]}


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_gpus_equal_tensor_parallel_size(tp):
    resources = server(render(body(tensorParallelSize=tp), CONFIG))["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == tp
    assert resources["limits"]["nvidia.com/gpu"] == tp


def test_extra_resources_keep_gpus_from_tp():
    m = render(
        body(
            tensorParallelSize=2, resources={"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "64Gi"}}
        ),
        CONFIG,
    )
    assert server(m)["resources"] == {
        "requests": {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": 2},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": 2},
    }


@pytest.mark.parametrize("tp, has_shm", [(1, False), (2, True), (8, True)])
def test_dev_shm_only_with_tensor_parallelism(tp, has_shm):
    m = render(body(tensorParallelSize=tp), CONFIG)
    assert ("dshm" in volume_names(m)) is has_shm
    mounts = {v["mountPath"] for v in server(m)["volumeMounts"]}
    assert ("/dev/shm" in mounts) is has_shm
    if has_shm:
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{2 * tp}Gi"}} in pod(m)["volumes"]


def test_probes_and_grace_period():
    m = render(body(startupTimeoutSeconds=2405, drainTimeoutSeconds=45, port=9000), CONFIG)
    container = server(m)
    startup, readiness, liveness = (container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert startup["httpGet"] == {"path": "/ready", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 2405
    assert startup["failureThreshold"] == math.ceil(2405 / startup["periodSeconds"])
    assert readiness["httpGet"] == {"path": "/ready", "port": "http"}
    assert liveness["httpGet"] == {"path": "/health", "port": "http"}
    assert container["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    grace = pod(m)["terminationGracePeriodSeconds"]
    assert grace > 45 and grace == PRESTOP_SLEEP_SECONDS + 45 + GRACE_MARGIN_SECONDS
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(PRESTOP_SLEEP_SECONDS)]
    assert pod(m)["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    args = container["args"]
    assert args[args.index("--drain-timeout") + 1] == "45"
    assert m.deployment["spec"]["progressDeadlineSeconds"] > 2405


def test_command_and_image():
    container = server(render(body(), CONFIG))
    assert container["command"] == list(SERVE_COMMAND)
    assert container["image"] == CONFIG.default_image
    assert server(render(body(image="mine:2", imagePullPolicy="Always"), CONFIG))["image"] == "mine:2"


def test_owner_references_on_everything():
    m = render(
        body(
            modelCache={"size": "10Gi", "accessMode": "ReadWriteMany", "retainPolicy": "Delete"},
            routing={"inferencePool": True},
            replicas=2,
        ),
        CONFIG,
    )
    kinds = ["PersistentVolumeClaim", "NetworkPolicy", "NetworkPolicy", "Job", "Deployment", "Service"]
    kinds += ["PodDisruptionBudget", "PodMonitor", "InferencePool"]
    assert [manifest["kind"] for manifest in m.all()] == kinds
    for manifest in m.all():
        assert manifest["metadata"]["namespace"] == "ml"
        assert manifest["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "pagedllm.dev/v1alpha1",
                "kind": "PagedLLM",
                "name": "llama",
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]


def test_labels_and_selectors_match():
    m = render(body(), CONFIG)
    selector = m.deployment["spec"]["selector"]["matchLabels"]
    template_labels = m.deployment["spec"]["template"]["metadata"]["labels"]
    assert selector == selector_labels("llama")
    assert selector.items() <= template_labels.items()
    assert m.service["spec"]["selector"] == selector
    for manifest in m.all():
        assert labels("llama").items() <= manifest["metadata"]["labels"].items()


def test_owner_labels_are_inherited_but_never_override_ours():
    b = body()
    b["metadata"]["labels"] = {"team": "nlp", "app.kubernetes.io/name": "not-ours"}
    m = render(b, CONFIG)
    assert m.deployment["metadata"]["labels"]["team"] == "nlp"
    assert m.deployment["metadata"]["labels"]["app.kubernetes.io/name"] == "pagedllm"


def test_service_defaults_and_type():
    service = render(body(), CONFIG).service
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    public = render(body(serviceType="LoadBalancer", apiKeySecret={"name": "k"}), CONFIG).service
    assert public["spec"]["type"] == "LoadBalancer"


@pytest.mark.parametrize("service_type", ["NodePort", "LoadBalancer"])
def test_a_public_service_needs_an_api_key_or_an_explicit_allowance(service_type):
    with pytest.raises(SpecError) as refused:
        render(body(serviceType=service_type), CONFIG)
    assert str(refused.value) == (
        f"spec.serviceType={service_type!r} is not allowed without spec.apiKeySecret: the Service is reachable from "
        "outside the cluster and the server would answer anyone; set apiKeySecret, use serviceType 'ClusterIP', "
        "or set allowUnauthenticatedPublicService: true to serve it without a key"
    )
    allowed = render(body(serviceType=service_type, allowUnauthenticatedPublicService=True), CONFIG)
    assert allowed.service["spec"]["type"] == service_type
    assert render(body(allowUnauthenticatedPublicService=False), CONFIG).service["spec"]["type"] == "ClusterIP"


def test_generation_is_recorded_on_the_deployment():
    assert render(body(generation=7), CONFIG).deployment["metadata"]["annotations"] == {GENERATION_ANNOTATION: "7"}


def test_replicas_and_rollout_strategy():
    m = render(body(replicas=3), CONFIG)
    assert m.deployment["spec"]["replicas"] == 3
    assert m.deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    assert render(body(), CONFIG).deployment["spec"]["strategy"] == {"type": "Recreate"}
    rolling = render(body(rolloutStrategy="RollingUpdate"), CONFIG).deployment["spec"]["strategy"]
    assert rolling == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def test_non_root_security_context():
    m = render(body(), CONFIG)
    security = pod(m)["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == RUN_AS
    for container in pod(m)["containers"] + pod(m).get("initContainers", []):
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod(m)["automountServiceAccountToken"] is False


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_hub_model_is_downloaded_with_the_token_and_served_from_the_volume():
    m = render(body(hfTokenSecret={"name": "hf", "key": "tok"}), CONFIG)
    (fetch,) = pod(m)["initContainers"]
    token = {"secretKeyRef": {"name": "hf", "key": "tok"}}
    assert env_of(fetch)["HF_TOKEN"] == token
    assert "HF_TOKEN" not in env_of(server(m))  # the server reads local files only
    assert fetch["command"] == [
        "pagedllm",
        "download",
        "hf://meta-llama/Llama-2-7b-hf",
        "/models/meta-llama/Llama-2-7b-hf",
    ]
    args = server(m)["args"]
    assert args[args.index("--model") + 1] == "/models/meta-llama/Llama-2-7b-hf"
    assert {"name": "models", "emptyDir": {"sizeLimit": "21Gi"}} in pod(m)["volumes"]  # 16 GiB x 1.2 + 1
    assert m.pvc is None


def credentials_in(container: dict) -> list:
    """The download credentials a container can read: the Hub token, a credentials Secret."""
    return [e["name"] for e in container.get("env", []) if e["name"] == "HF_TOKEN"] + container.get("envFrom", [])


@pytest.mark.parametrize("nodes", [1, 2])
def test_download_credentials_reach_only_the_container_that_downloads(nodes):
    token = {"hfTokenSecret": {"name": "hf"}, "modelSource": {"credentialsSecret": {"name": "s3"}}}
    cache = {"modelCache": {"size": "100Gi"}}
    m = render(body(nodes=nodes, **token, **cache), CONFIG)
    (download,) = m.job["spec"]["template"]["spec"]["containers"]
    assert credentials_in(download) == ["HF_TOKEN", {"secretRef": {"name": "s3"}}]
    templates = (
        [m.deployment["spec"]["template"]]
        if nodes == 1
        else [m.deployment["spec"]["leaderWorkerTemplate"][t] for t in ("leaderTemplate", "workerTemplate")]
    )
    for template in templates:
        (wait,) = template["spec"]["initContainers"]
        (serve,) = template["spec"]["containers"]
        assert (wait["name"], credentials_in(wait), credentials_in(serve)) == ("wait-for-model", [], [])
        assert env_of(serve)["HF_HOME"] == "/models/.hf"


def test_model_cache_claim_backs_the_models_volume():
    m = render(body(modelCache={"size": "100Gi", "storageClassName": "fast", "accessMode": "ReadWriteMany"}), CONFIG)
    assert m.pvc["metadata"]["name"] == "llama-model-cache"
    assert m.pvc["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "100Gi"}},
        "storageClassName": "fast",
    }
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "llama-model-cache"}} in pod(m)["volumes"]
    assert m.all()[0] is m.pvc  # applied before the pods that mount it


def test_pvc_source_mounts_the_claim_read_only():
    m = render(body(modelSource={"type": "pvc", "pvc": {"claimName": "weights", "path": "llama/7b"}}), CONFIG)
    assert "initContainers" not in pod(m)
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod(m)["volumes"]
    assert {"name": "model", "mountPath": "/model", "readOnly": True, "subPath": "llama/7b"} in server(m)[
        "volumeMounts"
    ]
    args = server(m)["args"]
    assert args[args.index("--model") + 1] == "/model"
    assert args[args.index("--served-model-name") + 1] == "meta-llama/Llama-2-7b-hf"


def test_absolute_model_path_is_used_as_is():
    m = render(body(model="/opt/models/tiny"), CONFIG)
    assert "initContainers" not in pod(m) and volume_names(m) == {"tmp", "home"}  # only the writable scratch dirs
    args = server(m)["args"]
    assert args[args.index("--model") + 1] == "/opt/models/tiny"


def test_api_key_comes_from_its_secret_not_argv():
    m = render(body(apiKeySecret={"name": "keys"}), CONFIG)
    assert env_of(server(m))[API_KEY_ENV] == {"secretKeyRef": {"name": "keys", "key": "api-key"}}
    assert "--api-key" not in server(m)["args"]


def test_user_env_scheduling_fields_pass_through():
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]}]
            }
        }
    }
    m = render(
        body(
            env=[{"name": "NCCL_DEBUG", "value": "INFO"}],
            nodeSelector={"gpu": "a100"},
            tolerations=[toleration],
            affinity=affinity,
        ),
        CONFIG,
    )
    assert env_of(server(m))["NCCL_DEBUG"] == "INFO"
    assert pod(m)["nodeSelector"] == {"gpu": "a100"}
    assert pod(m)["tolerations"] == [toleration] and pod(m)["affinity"] == affinity


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"env": [{"name": "HF_TOKEN", "value": "x"}]}, r"spec.env\[0\].name='HF_TOKEN'"),
        ({"blockSize": 12}, r"spec.blockSize=12 is not allowed: choose one of \[8, 16, 32, 64, 128\]"),
        ({"gpuMemoryUtilization": 1.5}, r"spec.gpuMemoryUtilization=1.5 is out of range: must be >= 0.1 and <= 0.99"),
        ({"replicas": -1}, r"spec.replicas=-1 is out of range: must be >= 0"),
        ({"tensorParallelSize": "2"}, r"spec.tensorParallelSize='2' has the wrong type: must be int"),
        ({"resources": {"limits": {"nvidia.com/gpu": 1}}}, r"GPUs come from tensorParallelSize"),
        ({"resources": {"limits": {"memory": "lots"}}}, r"is not a quantity"),
        ({"modelSource": {"type": "pvc"}}, r"spec.modelSource.pvc is required"),
        ({"bogus": 1}, r"unknown field\(s\) \['bogus'\]"),
    ],
)
def test_specs_the_operator_refuses_say_what_and_why(spec, message):
    with pytest.raises(SpecError, match=message):
        render(body(**spec), CONFIG)


@pytest.mark.parametrize("name", ["Llama", "7b", "a.b", "x" * 64])
def test_names_that_cannot_name_a_service_are_refused(name):
    with pytest.raises(SpecError, match="DNS-1035"):
        render(body(name=name), CONFIG)


def test_missing_model_is_refused():
    b = body()
    del b["spec"]["model"]
    with pytest.raises(SpecError, match="spec.model is required"):
        render(b, CONFIG)


FULL = dict(
    tensorParallelSize=2,
    replicas=2,
    hfTokenSecret={"name": "hf"},
    apiKeySecret={"name": "k"},
    modelCache={"size": "10Gi", "accessMode": "ReadWriteMany"},
    resources={"requests": {"cpu": 4}},
    nodeSelector={"a": "b"},
    tolerations=[{"key": "k", "operator": "Exists"}],
    env=[{"name": "A", "value": "1"}],
    rolloutStrategy="RollingUpdate",
    serviceType="NodePort",
    extraArgs=["--enable-chunked-prefill"],
)


@pytest.mark.parametrize(
    "spec", [{}, FULL, {"modelSource": {"type": "pvc", "pvc": {"claimName": "w"}}}, {"model": "/opt/m"}]
)
def test_rendered_manifests_validate_against_kubernetes_schemas(spec):
    for manifest in render(body(**spec), CONFIG).all():
        validate_manifest(manifest)
