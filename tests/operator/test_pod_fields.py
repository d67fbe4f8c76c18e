"""Cluster-compatibility fields of the spec, rendered into the pod; the CRD and the operator refuse the same."""

from __future__ import annotations

import pytest
from crd_jsonschema import apply_defaults, failed_cel_rules
from resource_factories import CONFIG, body, pod, resource, server
from third_party_schemas import validate_manifest

from pagedllm.operator.manifests import HOME_DIR, render, selector_labels
from pagedllm.operator.spec import PagedLLMSpec, SpecError


@pytest.mark.parametrize("gpu", ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "amd.com/gpu", "gpu.intel.com/i915"])
def test_gpu_resource_name_is_what_each_pod_requests(gpu):
    resources = server(render(body(gpuResourceName=gpu, tensorParallelSize=2), CONFIG))["resources"]
    assert resources["requests"][gpu] == 2 and resources["limits"][gpu] == 2
    assert {name for part in resources.values() for name in part if "/" in name} == {gpu}


def test_default_gpu_resource_is_nvidia():
    limits = server(render(body(), CONFIG))["resources"]["limits"]
    assert [name for name in limits if "/" in name] == ["nvidia.com/gpu"] and limits["nvidia.com/gpu"] == 1


def test_pod_fields_pass_through():
    spread = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
    m = render(
        body(
            imagePullSecrets=[{"name": "regcred"}],
            podAnnotations={"sidecar.istio.io/inject": "false"},
            podLabels={"team": "ml"},
            priorityClassName="inference-high",
            runtimeClassName="nvidia",
            serviceAccountName="llm-reader",
            topologySpreadConstraints=[spread],
        ),
        CONFIG,
    )
    p, meta = pod(m), m.deployment["spec"]["template"]["metadata"]
    assert p["imagePullSecrets"] == [{"name": "regcred"}]
    assert meta["annotations"]["sidecar.istio.io/inject"] == "false"
    assert meta["annotations"]["prometheus.io/port"] == "8000"  # the scrape annotations stay
    assert meta["labels"]["team"] == "ml" and meta["labels"]["app.kubernetes.io/instance"] == "llama"
    assert (p["priorityClassName"], p["runtimeClassName"], p["serviceAccountName"]) == (
        "inference-high",
        "nvidia",
        "llm-reader",
    )
    assert p["automountServiceAccountToken"] is False
    assert p["topologySpreadConstraints"] == [{**spread, "labelSelector": {"matchLabels": selector_labels("llama")}}]
    for manifest in m.all():
        validate_manifest(manifest)


def test_unset_pod_fields_are_not_rendered():
    p = pod(render(body(), CONFIG))
    for key in ("imagePullSecrets", "priorityClassName", "runtimeClassName", "serviceAccountName"):
        assert key not in p
    assert "topologySpreadConstraints" not in p


def test_root_filesystem_is_read_only_with_writable_scratch_dirs():
    m = render(body(), CONFIG)
    containers = pod(m)["containers"] + pod(m)["initContainers"]
    volumes = {v["name"]: v for v in pod(m)["volumes"]}
    assert volumes["tmp"] == {"name": "tmp", "emptyDir": {}} and volumes["home"] == {"name": "home", "emptyDir": {}}
    for container in containers:
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        paths = {mount["mountPath"] for mount in container["volumeMounts"]}
        assert {"/tmp", HOME_DIR} <= paths, container["name"]
    assert pod(m)["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    assert server(m)["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"


BAD = [
    ({"gpuResourceName": "gpu"}, "gpuResourceName"),
    ({"gpuResourceName": "kubernetes.io/gpu"}, "gpuResourceName"),
    ({"podLabels": {"app.kubernetes.io/instance": "other"}}, "podLabels"),
    ({"modelCache": {"size": "10Gi"}, "replicas": 2}, "ReadWriteOnce"),
    ({"modelCache": {"size": "10Gi"}, "autoscaling": {"maxReplicas": 3, "target": 4}}, "ReadWriteOnce"),
]


@pytest.mark.parametrize("spec, field", BAD)
def test_the_operator_refuses_naming_the_field(spec, field):
    with pytest.raises(SpecError, match=field):
        PagedLLMSpec.from_dict({"model": "org/model", **spec})


@pytest.mark.parametrize("spec, field", [b for b in BAD if b[0] != {"gpuResourceName": "gpu"}])  # that one: pattern
def test_the_crd_rules_refuse_the_same(crd_schema, spec, field):
    failed = failed_cel_rules(crd_schema, apply_defaults(crd_schema, resource(**spec)))
    assert failed, spec


def test_a_shared_cache_with_several_replicas_is_accepted(crd_schema):
    spec = {"modelCache": {"size": "10Gi", "accessMode": "ReadWriteMany"}, "replicas": 3}
    assert failed_cel_rules(crd_schema, apply_defaults(crd_schema, resource(**spec))) == []
    PagedLLMSpec.from_dict({"model": "org/model", **spec})
    assert failed_cel_rules(crd_schema, apply_defaults(crd_schema, resource(gpuResourceName="amd.com/gpu"))) == []
