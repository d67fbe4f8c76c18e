"""Scale from zero on KEDA's HTTP add-on: the HTTPScaledObject (validated against the add-on's vendored CRD)
and the NAME-http Service in front of the model's own, rendered only with minReplicas 0 and the interceptor."""

from __future__ import annotations

import copy
import functools
import gzip
from pathlib import Path

import jsonschema
import pytest
import yaml
from api_schemas import ApiSchemas, SchemaError
from crd_jsonschema import to_jsonschema
from resource_factories import body

from pagedllm.operator.keda_http import parse_interceptor
from pagedllm.operator.manifests import RenderConfig, render

# kedacore/http-add-on config/crd/bases/http.keda.sh_httpscaledobjects.yaml, as published (gzip).
HTTP_CRD = Path(__file__).parent / "schemas" / "http.keda.sh_httpscaledobjects.yaml.gz"
INTERCEPTOR = "keda-add-ons-http-interceptor-proxy.keda:8080"
KEDA_HTTP = RenderConfig(default_image="img", autoscaler="keda", http_interceptor=INTERCEPTOR)
FROM_ZERO = {"minReplicas": 0, "maxReplicas": 4, "metric": "queue", "target": 8, "scaleDownDelaySeconds": 600}


@functools.cache
def http_validator() -> jsonschema.Draft202012Validator:
    crd = yaml.safe_load(gzip.open(HTTP_CRD))
    assert crd["metadata"]["name"] == "httpscaledobjects.http.keda.sh"
    (version,) = crd["spec"]["versions"]
    schema = to_jsonschema(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_from_zero_renders_an_http_scaled_object_the_add_on_accepts():
    fleet = render(body(autoscaling=FROM_ZERO, startupTimeoutSeconds=1200), KEDA_HTTP).fleet
    scaled = fleet.autoscaler
    assert (scaled["apiVersion"], scaled["kind"]) == ("http.keda.sh/v1alpha1", "HTTPScaledObject")
    errors = [e.message for e in http_validator().iter_errors(scaled)]
    assert not errors, errors
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "llama",
        "service": "llama",
        "port": 8000,
    }
    assert spec["replicas"] == {"min": 0, "max": 4} and spec["scaledownPeriod"] == 600
    assert spec["hosts"] == ["llama-http", "llama-http.ml", "llama-http.ml.svc", "llama-http.ml.svc.cluster.local"]
    assert spec["timeouts"]["conditionWait"] == "1800s"  # the startup budget plus the time before it counts
    assert scaled["metadata"]["ownerReferences"][0]["kind"] == "PagedLLM"
    proxy = fleet.proxy_service
    assert proxy["metadata"]["name"] == "llama-http"
    assert proxy["spec"] == {
        "type": "ExternalName",
        "externalName": "keda-add-ons-http-interceptor-proxy.keda.svc.cluster.local",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }
    assert proxy in render(body(autoscaling=FROM_ZERO), KEDA_HTTP).all()


@pytest.mark.parametrize(
    "scaling, config",
    [
        ({**FROM_ZERO, "minReplicas": 1}, KEDA_HTTP),  # not from zero: the Prometheus trigger
        (FROM_ZERO, RenderConfig(default_image="img", autoscaler="keda")),  # no add-on
    ],
)
def test_otherwise_the_scaled_object_stays(scaling, config):
    fleet = render(body(autoscaling=scaling), config).fleet
    assert fleet.autoscaler["kind"] == "ScaledObject" and fleet.proxy_service is None


def test_a_leaderworkerset_is_the_target_and_keeps_the_service():
    scaled = render(body(autoscaling=FROM_ZERO, nodes=2), KEDA_HTTP).fleet.autoscaler
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["kind"], target["service"], target["port"]) == ("LeaderWorkerSet", "llama", 8000)
    assert not [e.message for e in http_validator().iter_errors(scaled)]


@pytest.mark.parametrize("value", ["proxy:8080", "proxy.keda", "proxy.keda:http", "proxy.keda:0"])
def test_a_bad_interceptor_address_is_refused(value):
    with pytest.raises(ValueError, match="SERVICE.NAMESPACE:PORT"):
        parse_interceptor(value)
    with pytest.raises(ValueError):
        RenderConfig(default_image="img", http_interceptor=value)


def test_the_add_ons_cel_rule_holds_for_the_rendering_as_the_emulated_api_server_checks_it():
    scaled = render(body(autoscaling=FROM_ZERO), KEDA_HTTP).fleet.autoscaler
    ApiSchemas().admit(scaled)  # the vendored CRD's schema, defaults and x-kubernetes-validations
    both = copy.deepcopy(scaled)
    both["spec"]["scaleTargetRef"]["portName"] = "http"
    with pytest.raises(SchemaError, match=r"spec.scaleTargetRef: .*must define either the 'portName' or the 'port'"):
        ApiSchemas().admit(both)
