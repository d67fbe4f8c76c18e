"""The PagedLLM CRD: shape, schema sanity, agreement with the operator and the engine.

Everything offline: the CRD object is validated against Kubernetes' own OpenAPI schema
with ``kubernetes-validate`` (bundled schemas, network blocked during the check), its
openAPIV3Schema is turned into a JSON Schema to validate defaults and examples, and the
CEL rules run through ``celpy`` (cel-python) when it is installed.
"""

from __future__ import annotations

import copy
import dataclasses
import socket
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from crd_jsonschema import apply_defaults, failed_cel_rules, resource_validator, spec_schema, to_jsonschema, walk
from resource_factories import resource

from pagedllm.operator.command import ENGINE_FIELDS, spec_attr
from pagedllm.operator.manifests import GRACE_MARGIN_SECONDS, PRESTOP_SLEEP_SECONDS, RenderConfig, render
from pagedllm.operator.spec import PagedLLMSpec, SpecError
from pagedllm.server import config as engine_config
from pagedllm.server.entrypoints.openai.errors import unavailable

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
K8S_VERSIONS = ("1.25", "1.30", kubernetes_validate.utils.major_minor(kubernetes_validate.utils.latest_version()))


@pytest.fixture()
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_names_scope_and_subresources(crd):
    assert crd["metadata"]["name"] == "pagedllms.pagedllm.dev"
    spec = crd["spec"]
    assert (spec["group"], spec["scope"]) == ("pagedllm.dev", "Namespaced")
    assert spec["names"]["kind"] == "PagedLLM" and spec["names"]["plural"] == "pagedllms"
    assert spec["names"]["shortNames"] == ["pllm"]
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }


def test_printer_columns(crd, crd_schema):
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [c["name"] for c in columns] == [
        "Model",
        "TP",
        "Block",
        "Ready",
        "Phase",
        "Endpoint",
        "Desired",
        "Current",
        "Age",
    ]
    # desired vs current replicas (the autoscaler's choice) in kubectl get -o wide
    assert [c["name"] for c in columns if c.get("priority")] == ["Desired", "Current"]
    for column in columns[:-1]:  # every path exists in the schema
        node = crd_schema
        for part in column["jsonPath"].strip(".").split("."):
            node = node["properties"][part]
        assert node["type"] == column["type"], column


def test_every_spec_and_status_field_is_described(crd_schema):
    missing = [
        path
        for path, sub in walk(crd_schema)
        if path.startswith(("spec", "status"))
        and path.split(".")[-1] not in ("", "[]")
        and not path.endswith(("{}", "[]"))
        and "description" not in sub
    ]
    assert not missing, f"fields without a description: {missing}"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_crd_validates_against_the_kubernetes_openapi_schema_offline(crd, version, no_network):
    assert kubernetes_validate.validate(crd, version, strict=True) == version


def test_the_offline_validation_catches_schema_mistakes(crd, no_network):
    typo = copy.deepcopy(crd)
    typo["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["port"]["minimun"] = 1
    with pytest.raises(kubernetes_validate.ValidationError, match="minimun"):
        kubernetes_validate.validate(typo, "1.30", strict=True)
    wrong_type = copy.deepcopy(crd)
    wrong_type["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["port"][
        "maximum"
    ] = "high"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, "1.30", strict=True)


def description(crd_schema: dict, field: str) -> str:
    return " ".join(spec_schema(crd_schema)["properties"][field]["description"].split())


def test_drain_text_gives_the_grace_period_the_operator_renders(crd_schema):
    text = description(crd_schema, "drainTimeoutSeconds")
    assert f"terminationGracePeriodSeconds is {PRESTOP_SLEEP_SECONDS + GRACE_MARGIN_SECONDS} s longer" in text
    assert f"a {PRESTOP_SLEEP_SECONDS} s preStop pause" in text and f"{GRACE_MARGIN_SECONDS} s are left" in text
    body = {"metadata": {"name": "m", "namespace": "n", "uid": "u"}, "spec": {"model": "m", "drainTimeoutSeconds": 40}}
    pod = render(body, RenderConfig(default_image="img")).deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 40 + PRESTOP_SLEEP_SECONDS + GRACE_MARGIN_SECONDS
    (container,) = pod["containers"]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(PRESTOP_SLEEP_SECONDS)]


def test_queue_text_gives_the_status_a_full_queue_answers(crd_schema):
    text = description(crd_schema, "maxQueueLen")
    refusal = unavailable("the waiting queue is full")  # what the server raises (OpenAIServing.check_queue)
    assert f"HTTP {refusal.status} with a {next(iter(refusal.headers))} header" in text
    assert "429" not in text


def test_every_default_is_valid_for_its_own_schema(crd_schema):
    checked = 0
    for _path, sub in walk(crd_schema):
        if "default" in sub:
            jsonschema.validate(sub["default"], to_jsonschema(sub))
            checked += 1
    assert checked >= 15


def test_bounds_are_sane(crd_schema):
    for path, sub in walk(crd_schema):
        if "minimum" in sub and "maximum" in sub:
            assert sub["minimum"] <= sub["maximum"], path
        if "enum" in sub:
            assert len(set(map(str, sub["enum"]))) == len(sub["enum"]), path
        assert not ("default" in sub and path in spec_schema(crd_schema).get("required", [])), path


def test_operator_spec_mirrors_the_schema(crd_schema):
    """Defaults, enums and ranges of operator/spec.py equal the CRD's (one source of truth)."""
    props = spec_schema(crd_schema)["properties"]
    fields = {f.metadata["key"]: f for f in dataclasses.fields(PagedLLMSpec)}
    assert set(fields) == set(props)
    for key, f in fields.items():
        prop = props[key]
        if f.default is not dataclasses.MISSING and f.default is not None and "kind" in f.metadata:
            assert prop.get("default") == f.default, key
        elif "kind" in f.metadata:
            assert "default" not in prop, key
        meta = f.metadata
        if "kind" not in meta:
            continue
        assert tuple(prop.get("enum", ())) == meta["choices"], key
        assert prop.get("minimum") == meta["minimum"] and prop.get("maximum") == meta["maximum"], key
        assert prop["type"] == {int: "integer", float: "number", str: "string", bool: "boolean"}[meta["kind"]], key
    assert spec_schema(crd_schema)["required"] == ["model"]


def test_engine_fields_agree_with_the_engine(crd_schema):
    """Choices fit the engine's, and defaults equal the engine's own defaults."""
    props = spec_schema(crd_schema)["properties"]
    engine = {f.name: f for f in engine_config.engine_fields()}
    for key, field_name in ENGINE_FIELDS.items():
        assert field_name in engine, f"{key} maps to unknown engine field {field_name}"
        if key == "model":
            continue
        default = engine[field_name].default
        if "default" not in props[key] and PagedLLMSpec.__dataclass_fields__[spec_attr(key)].default is None:
            continue  # unset is not rendered: the engine's own default applies
        if field_name == "block_size":  # NOTE: the engine's depends on the device; a PagedLLM's pods run on GPUs
            default = engine_config.CacheConfig().with_block_size("cuda").block_size
        assert props[key].get("default") == default, f"spec.{key} default vs engine {field_name}={default!r}"
        choices = engine[field_name].metadata.get("choices")
        if choices:
            assert set(props[key]["enum"]) <= set(choices), key
    for size in props["blockSize"]["enum"]:
        engine_config.CacheConfig(block_size=size)


def example_resources() -> list[dict]:
    docs = [doc for path in EXAMPLES for doc in yaml.safe_load_all(path.read_text()) if doc]
    return [doc for doc in docs if doc.get("kind") == "PagedLLM"]


def test_examples_exist_and_validate(crd_schema):
    resources = example_resources()
    assert len(resources) >= 2, "examples/ should show a PagedLLM or two"
    for example in resources:
        defaulted = apply_defaults(crd_schema, example)
        resource_validator(crd_schema).validate(defaulted)
        assert not failed_cel_rules(crd_schema, defaulted, required=False)
        render(
            {**defaulted, "metadata": {**defaulted["metadata"], "namespace": "ns", "uid": "u"}},
            RenderConfig(default_image="img"),
        )


# -- CEL rules ----------------------------------------------------------------------------


CEL_CASES = [
    (resource(), None),
    (resource(modelSource={"type": "pvc"}), "modelSource.pvc is required"),
    (resource(modelSource={"type": "pvc", "pvc": {"claimName": "weights"}}), None),
    (resource(modelSource={"type": "huggingface", "pvc": {"claimName": "weights"}}), "modelSource.pvc is required"),
    (resource(modelSource={"type": "pvc", "pvc": {"claimName": "w", "path": "/abs"}}), "relative to the claim"),
    (resource(modelSource={"type": "pvc", "pvc": {"claimName": "w", "path": "a/../b"}}), "relative to the claim"),
    (
        resource(modelSource={"type": "pvc", "pvc": {"claimName": "w"}}, modelCache={"size": "1Gi"}),
        "modelCache caches Hugging Face downloads",
    ),
    (resource(maxNumSeqs=64, maxNumBatchedTokens=32), "maxNumBatchedTokens must be at least maxNumSeqs"),
    (resource(maxNumSeqs=64, maxNumBatchedTokens=64), None),
    (resource(resources={"limits": {"nvidia.com/gpu": 1}}), "from resources.limits"),
    (resource(resources={"requests": {"nvidia.com/gpu": 1, "cpu": 2}}), "from resources.requests"),
    (resource(gpuResourceName="amd.com/gpu", resources={"limits": {"amd.com/gpu": 1}}), "from resources.limits"),
    (resource(gpuResourceName="amd.com/gpu", resources={"limits": {"nvidia.com/gpu": 1}}), "from resources.limits"),
    (resource(gpuResourceName="amd.com/gpu", resources={"limits": {"memory": "8Gi"}}), None),
    (resource(resources={"requests": {"cpu": "2"}, "limits": {"memory": "8Gi"}}), None),
    (resource(model="org/../etc"), "must not contain '..'"),
    (resource(autoscaling={"maxReplicas": 4, "target": 2}), None),
    (resource(replicas=1, autoscaling={"maxReplicas": 4, "target": 2}), "replicas and autoscaling exclude each other"),
    (resource(autoscaling={"minReplicas": 5, "maxReplicas": 4, "target": 2}), "minReplicas must be at most"),
    (resource(autoscaling={"maxReplicas": 4, "metric": "kvCache", "target": 1.5}), "kvCache metric is a fraction"),
    (resource(autoscaling={"maxReplicas": 4, "metric": "kvCache", "target": 1}), None),
    (resource(autoscaling={"minReplicas": 0, "maxReplicas": 2, "metric": "kvCache", "target": 0.8}), None),
    (resource(modelSource={"uri": "s3://bucket/llama"}), None),
    (resource(modelSource={"uri": "hf://org/name", "revision": "v1.0"}), None),
    (resource(modelSource={"revision": "abc123"}), None),
    (resource(modelSource={"uri": "s3://b/p", "type": "huggingface"}), "remove modelSource.type"),
    (resource(modelSource={"uri": "s3://b/p", "revision": "v1"}), "modelSource.revision pins a Hugging Face Hub"),
    (resource(modelSource={"type": "pvc", "pvc": {"claimName": "w"}, "revision": "v1"}), "modelSource.revision pins"),
    (
        resource(modelSource={"uri": "pvc://w/p"}, modelCache={"size": "1Gi"}),
        "modelCache caches Hugging Face downloads",
    ),
    (resource(modelSource={"uri": "s3://b/p"}, modelCache={"size": "1Gi", "retainPolicy": "Delete"}), None),
    (resource(replicas=3, rollout={"maxSurge": 1, "maxUnavailable": "25%"}), None),
    (resource(rolloutStrategy="Recreate", rollout={"maxSurge": 1}), "rollout sets the bounds of a RollingUpdate"),
    (resource(serviceType="LoadBalancer"), "reachable from outside the cluster: set apiKeySecret"),
    (resource(serviceType="NodePort"), "reachable from outside the cluster: set apiKeySecret"),
    (resource(serviceType="LoadBalancer", apiKeySecret={"name": "k"}), None),
    (resource(serviceType="NodePort", allowUnauthenticatedPublicService=True), None),
    (resource(serviceType="ClusterIP"), None),
    ({**resource(), "metadata": {"name": "Llama"}}, "DNS-1035 label"),
    ({**resource(), "metadata": {"name": "7b"}}, "DNS-1035 label"),
    ({**resource(), "metadata": {"name": "x" * 64}}, "DNS-1035 label"),
]


@pytest.mark.parametrize("obj, expected", CEL_CASES)
def test_cel_rules_accept_and_refuse(crd_schema, obj, expected):
    defaulted = apply_defaults(crd_schema, obj)
    failed = failed_cel_rules(crd_schema, defaulted)
    if expected is None:
        assert failed == []
    else:
        assert any(expected in message for message in failed), failed


@pytest.mark.parametrize("obj, expected", [(o, e) for o, e in CEL_CASES if "metadata" not in str(e)])
def test_operator_refuses_what_cel_refuses(crd_schema, obj, expected):
    """The operator's own parsing is the same fence as the CRD's rules (for old clusters)."""
    spec = apply_defaults(crd_schema, obj)["spec"]
    if expected is None or "DNS-1035" in expected:
        PagedLLMSpec.from_dict(spec)
    else:
        with pytest.raises(SpecError):
            PagedLLMSpec.from_dict(spec)


@pytest.mark.parametrize("picker, valid", [("epp", True), ("my-epp-2", True), ("EPP", False), ("x" * 64, False)])
def test_the_endpoint_picker_name_is_a_service_name(crd_schema, picker, valid):
    obj = apply_defaults(crd_schema, resource(routing={"inferencePool": True, "endpointPicker": {"name": picker}}))
    errors = list(resource_validator(crd_schema).iter_errors(obj))
    assert (errors == []) == valid, errors
