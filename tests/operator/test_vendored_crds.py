"""The other projects' kinds the operator writes, admitted by the emulated API server through their upstream
CRDs (``schemas/``) as a cluster with those CRDs installed admits them: the rendered objects pass
``fieldValidation=Strict`` and are stored with the CRDs' defaults; a typo is a 422 under ``Strict`` and
pruned with a warning otherwise; a value outside an enum and a broken CEL rule are 422s."""

from __future__ import annotations

import copy
import gzip

import pytest
import yaml
from api_schemas import SCHEMAS, VENDORED_CRDS
from resource_factories import KEDA, body

from pagedllm.operator.manifests import RenderConfig, render

NS = "ml"
PATHS = {
    "ScaledObject": f"/apis/keda.sh/v1alpha1/namespaces/{NS}/scaledobjects",
    "HTTPScaledObject": f"/apis/http.keda.sh/v1alpha1/namespaces/{NS}/httpscaledobjects",
    "InferencePool": f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools",
    "PodMonitor": f"/apis/monitoring.coreos.com/v1/namespaces/{NS}/podmonitors",
}
KEDA_HTTP = RenderConfig(default_image="img", autoscaler="keda", http_interceptor="proxy.keda:8080")
SCALING = {"maxReplicas": 4, "target": 3}


def rendered(kind: str, name: str) -> dict:
    """The operator's rendering of ``kind``, named ``name`` and without its owner (none exists here)."""
    if kind == "HTTPScaledObject":
        manifests = render(body(autoscaling={**SCALING, "minReplicas": 0}), KEDA_HTTP)
    else:
        manifests = render(body(routing={"inferencePool": True}, autoscaling=SCALING), KEDA)
    (obj,) = [m for m in manifests.all() if m["kind"] == kind]
    obj = copy.deepcopy(obj)
    obj["metadata"] = {"name": name, "namespace": NS, "labels": obj["metadata"]["labels"]}
    return obj


def post(api, obj: dict, validation: str = "Strict") -> tuple[int, dict, list[str]]:
    return api.send("POST", f"{PATHS[obj['kind']]}?fieldValidation={validation}", obj, "application/json")


@pytest.mark.parametrize("name", VENDORED_CRDS)
def test_each_vendored_crd_names_its_source_and_license(name):
    text = gzip.decompress((SCHEMAS / name).read_bytes()).decode()
    assert text.startswith("# Source: https://github.com/"), text[:200]
    assert "Licensed under the Apache License, Version 2.0" in text.split("\n---", 1)[0]
    crd = yaml.safe_load(text)
    group, plural = name.removesuffix(".yaml.gz").split("_")
    assert crd["kind"] == "CustomResourceDefinition" and crd["metadata"]["name"] == f"{plural}.{group}"


@pytest.mark.parametrize("kind", sorted(PATHS))
def test_the_rendered_objects_pass_strict_validation(api, kind):
    status, answer, warnings = post(api, rendered(kind, f"ok-{kind.lower()}"))
    assert status in (200, 201) and warnings == [], answer


def test_the_crds_defaults_are_stored(api):
    status, answer, _ = post(api, rendered("InferencePool", "defaulted"))
    assert status in (200, 201), answer
    stored = api.get("InferencePool", NS, "defaulted")
    assert stored["spec"]["appProtocol"] == "http"
    assert stored["spec"]["endpointPickerRef"]["group"] == ""


def field_names(value) -> set[str]:
    """Every field name anywhere in ``value``."""
    if isinstance(value, list):
        return set().union(*map(field_names, value))
    if isinstance(value, dict):
        return set(value).union(*map(field_names, value.values()))
    return set()


def _fallback(obj: dict, **fields) -> None:
    obj["spec"]["fallback"] = {"failureThreshold": 3, "replicas": 2, **fields}


def _namespaces(obj: dict, **fields) -> None:
    obj["spec"]["namespaceSelector"] = fields


TYPOS = {  # kind -> (mistake, the field path the answer names, the misspelt field)
    "ScaledObject": (lambda o: _fallback(o, behaviour="currentReplicas"), "spec.fallback", "behaviour"),
    "InferencePool": (
        lambda o: o["spec"]["endpointPickerRef"].update(failureMod="FailOpen"),
        "spec.endpointPickerRef",
        "failureMod",
    ),
    "PodMonitor": (lambda o: _namespaces(o, matchName=[NS]), "spec.namespaceSelector", "matchName"),
}


@pytest.mark.parametrize("kind", sorted(TYPOS))
def test_a_typo_is_refused_under_strict_and_pruned_with_a_warning_otherwise(api, kind):
    mistake, field, typo = TYPOS[kind]
    obj = rendered(kind, f"typo-{kind.lower()}")
    mistake(obj)
    status, answer, _ = post(api, obj)
    assert status == 422 and typo in answer["message"] and field in answer["message"], answer
    assert api.get(kind, NS, obj["metadata"]["name"]) is None
    status, answer, warnings = post(api, obj, "Warn")
    assert status in (200, 201), answer
    assert len(warnings) == 1 and typo in warnings[0], warnings
    assert typo not in field_names(api.get(kind, NS, obj["metadata"]["name"])["spec"])


ENUMS = {  # kind -> (mistake, field, the value outside the enum)
    "ScaledObject": (lambda o: _fallback(o, behavior="sometimes"), "spec.fallback.behavior", "sometimes"),
    "InferencePool": (lambda o: o["spec"].update(appProtocol="h2c"), "spec.appProtocol", "h2c"),
    "PodMonitor": (lambda o: o["spec"].update(fallbackScrapeProtocol="Text"), "spec.fallbackScrapeProtocol", "Text"),
}


@pytest.mark.parametrize("kind", sorted(ENUMS))
def test_a_value_outside_an_enum_is_refused(api, kind):
    mistake, field, value = ENUMS[kind]
    obj = rendered(kind, f"enum-{kind.lower()}")
    mistake(obj)
    for validation in ("Strict", "Warn"):
        status, answer, _ = post(api, obj, validation)
        assert status == 422, answer
        assert f"{field}: '{value}' is not one of" in answer["message"], answer


@pytest.mark.parametrize(
    ("kind", "mistake", "message"),
    [
        (
            "ScaledObject",
            lambda o: o["spec"].update(minReplicaCount=5),
            'spec: Invalid value: "object": minReplicaCount must be less than or equal to maxReplicaCount',
        ),
        (
            "InferencePool",
            lambda o: o["spec"]["selector"]["matchLabels"].update(tier="not a label value"),
            "spec.selector.matchLabels.tier: 'not a label value' does not match",
        ),
    ],
)
def test_the_crds_rules_beyond_types_are_checked(api, kind, mistake, message):
    obj = rendered(kind, f"rule-{kind.lower()}")
    mistake(obj)
    status, answer, _ = post(api, obj)
    assert status == 422 and message in answer["message"], answer
