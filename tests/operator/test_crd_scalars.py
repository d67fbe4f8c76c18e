"""Random scalar specs: the CRD schema (with its CEL rules) and the operator accept exactly the same ones."""

from __future__ import annotations

import pytest
from crd_jsonschema import apply_defaults, failed_cel_rules, resource_validator, spec_schema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from resource_factories import resource

from pagedllm.operator.spec import PagedLLMSpec, SpecError


def _scalar_values(prop: dict):
    kind = prop["type"]
    if "enum" in prop:
        good = st.sampled_from(prop["enum"])
        bad = st.sampled_from([7, 3, "other", 0.5, True]) if kind == "integer" else st.sampled_from(["other", 1])
        return st.one_of(good, bad)
    if kind == "boolean":
        return st.one_of(st.booleans(), st.sampled_from(["yes", 1]))
    if kind == "string":
        return st.one_of(st.sampled_from(["a", "org/model", "x y", ""]), st.integers(0, 3))
    low, high = prop.get("minimum"), prop.get("maximum")
    edges = [v for b in (low, high) if b is not None for v in (b, b - 1, b + 1)]
    if kind == "integer":
        return st.one_of(st.integers(-10, 10**7), st.sampled_from(edges or [0]), st.sampled_from(["4", 2.5]))
    return st.one_of(st.floats(-2, 2000, allow_nan=False), st.sampled_from(edges or [0.0]), st.just("0.5"))


SCALARS = [
    "replicas",
    "tensorParallelSize",
    "blockSize",
    "gpuMemoryUtilization",
    "maxNumSeqs",
    "maxNumBatchedTokens",
    "maxModelLen",
    "swapSpaceGiB",
    "dtype",
    "enablePrefixCaching",
    "kvCacheDtype",
    "quantization",
    "preemptionMode",
    "seed",
    "loadFormat",
    "port",
    "serviceType",
    "startupTimeoutSeconds",
    "drainTimeoutSeconds",
    "maxQueueLen",
    "logLevel",
    "rolloutStrategy",
    "imagePullPolicy",
]


@st.composite
def scalar_specs(draw, props):
    spec = {"model": "org/model"}
    for key in draw(st.lists(st.sampled_from(SCALARS), max_size=4, unique=True)):
        spec[key] = draw(_scalar_values(props[key]))
    return spec


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_schema_and_operator_accept_the_same_scalar_specs(crd_schema, data):
    """Whatever the CRD (schema + CEL) admits the operator serves, and nothing else."""
    pytest.importorskip("celpy", reason="cel-python evaluates the CRD's CEL rules offline")
    spec = data.draw(scalar_specs(spec_schema(crd_schema)["properties"]))
    obj = apply_defaults(crd_schema, resource(**{k: v for k, v in spec.items() if k != "model"}))
    admitted = resource_validator(crd_schema).is_valid(obj) and not failed_cel_rules(crd_schema, obj)
    try:
        PagedLLMSpec.from_dict(obj["spec"])
        served = True
    except SpecError:
        served = False
    assert admitted == served, spec
