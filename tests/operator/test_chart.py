"""The Helm chart through the real helm binary (installed by scripts/install-k8s-tools.sh).

`helm lint`, `helm template` and `helm install --dry-run=client` run offline; rendered
manifests are validated against Kubernetes' OpenAPI schemas with kubernetes-validate.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import textwrap

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helm_tools import CHART_DIR, CRD_PATH, ROOT, HelmError, rules_of, run_helm

from pagedllm.operator.main import add_operator_args
from pagedllm.operator.spec import PagedLLMSpec

RBAC_KINDS = {"ClusterRole", "Role"}


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for doc in docs:
        out.setdefault(doc["kind"], []).append(doc)
    return out


def operator_container(docs: list[dict]) -> dict:
    (deployment,) = by_kind(docs)["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def parse_operator_args(container: dict) -> argparse.Namespace:
    assert container["command"][:2] == ["pagedllm", "operator"]
    parser = argparse.ArgumentParser(prog="pagedllm operator")
    add_operator_args(parser)
    return parser.parse_args(container["command"][2:] + container["args"])


KEDA_RULES = {("keda.sh", "scaledobjects", v) for v in ("get", "list", "watch", "create", "patch", "delete")}
SWITCHES = [
    (),
    ("--set", "watchNamespaces={ml,research}", "--set", "crds.install=false"),
    ("--set", "autoscaler=keda", "--set", "prometheus.address=http://prom.monitoring.svc:9090"),
    ("--set", "autoscaler=keda", "--set", "watchNamespaces={ml}"),
    ("--set", "prometheus.podMonitorLabels.release=kps"),
    ("--set", "prometheusAdapter.rules.create=true"),
    ("--set", "clusterWide=true", "--set", "replicas=3"),
    ("--set", "policy.admissionPolicy=true", "--set", "policy.allowedImages={ghcr.io/pagedllm/*}"),
]
CLUSTER_WIDE = ("--set", "clusterWide=true")
LEASE_RULES = {("coordination.k8s.io", "leases", v) for v in ("get", "create", "patch")}


def roles(docs: list[dict]) -> dict[str, list[dict]]:
    """Roles by what they are for: "lease" (the leader election's), "serving" (the watched namespaces')."""
    found: dict[str, list[dict]] = {"lease": [], "serving": []}
    for role in by_kind(docs).get("Role", []):
        found["lease" if role["metadata"]["name"].endswith("-leader-election") else "serving"].append(role)
    return found


@pytest.mark.parametrize("flags", SWITCHES)
def test_helm_lint_passes(helm, flags):
    out = run_helm(helm, "lint", "--strict", str(CHART_DIR), *flags)
    assert "0 chart(s) failed" in out


def test_template_renders_crd_operator_and_rbac(helm_template):
    kinds = by_kind(helm_template())
    assert set(kinds) == {
        "CustomResourceDefinition",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Deployment",
        "PodDisruptionBudget",
    }
    (deployment,) = kinds["Deployment"]
    # Two replicas elect a leader, so a rollout never leaves the resources unserved.
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    (binding,) = kinds["ClusterRoleBinding"]
    (account,) = kinds["ServiceAccount"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "pagedllm-system"}
    ]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]


def test_chart_crd_is_a_byte_identical_copy():
    copy = CHART_DIR / "files" / "crds" / "pagedllm.yaml"
    assert copy.read_bytes() == CRD_PATH.read_bytes(), (
        f"{copy.relative_to(ROOT)} differs from crds/pagedllm.yaml: cp crds/pagedllm.yaml {copy.relative_to(ROOT)}"
    )


def test_rendered_crd_equals_the_source(helm_template):
    (crd,) = by_kind(helm_template())["CustomResourceDefinition"]
    assert crd == yaml.safe_load(CRD_PATH.read_text())


def test_crd_switch(helm_template):
    assert "CustomResourceDefinition" not in by_kind(helm_template("--set", "crds.install=false"))


def test_operator_serves_its_own_namespace_by_default_and_every_one_on_request(helm_template):
    args = parse_operator_args(operator_container(helm_template("--set", "clusterWide=true")))
    assert args.all_namespaces and args.namespaces == []
    container = operator_container(helm_template())
    args = parse_operator_args(container)
    assert args.standalone and args.leader_elect and not args.all_namespaces
    assert args.namespaces == ["pagedllm-system"]
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
    assert env["POD_NAMESPACE"] == "metadata.namespace" and env["POD_NAME"] == "metadata.name"
    # The operator runs from its own torch-free image; the servers it creates from the serving image.
    assert container["image"] == "ghcr.io/pagedllm/pagedllm-operator:0.1.0"
    assert args.default_image == "ghcr.io/pagedllm/pagedllm:0.1.0"
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    probe = container["livenessProbe"]["httpGet"]
    assert probe == {"path": "/healthz", "port": "liveness"}
    assert {"name": "liveness", "containerPort": 8080, "protocol": "TCP"} in container["ports"]
    assert args.metrics_port == 8081
    assert {"name": "metrics", "containerPort": 8081, "protocol": "TCP"} in container["ports"]


def test_operator_command_is_the_projects_console_script():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^\[project\.scripts\]\s*\npagedllm = "pagedllm\.server\.entrypoints\.cli:main"', pyproject, re.M)


def test_values_reach_the_operator(helm_template):
    docs = helm_template(
        "--set",
        "watchNamespaces={ml,research}",
        "--set",
        "servingImage.repository=reg/serve",
        "--set",
        "servingImage.tag=v9",
        "--set",
        "operator.logLevel=debug",
        "--set",
        "image.tag=1.2.3",
    )
    args = parse_operator_args(operator_container(docs))
    assert args.namespaces == ["ml", "research"] and not args.all_namespaces
    assert args.default_image == "reg/serve:v9" and args.debug
    assert operator_container(docs)["image"] == "ghcr.io/pagedllm/pagedllm-operator:1.2.3"
    docs = helm_template("--set", "image.repository=reg/operator", "--set", "servingImage.repository=reg/serve")
    assert operator_container(docs)["image"] == "reg/operator:0.1.0"
    assert parse_operator_args(operator_container(docs)).default_image == "reg/serve:0.1.0"


def test_autoscaler_and_prometheus_reach_the_operator(helm_template):
    args = parse_operator_args(operator_container(helm_template()))
    assert args.autoscaler == "hpa" and args.prometheus_address == "http://prometheus-operated.monitoring.svc:9090"
    docs = helm_template("--set", "autoscaler=keda", "--set", "prometheus.address=http://prom.monitoring.svc:9090")
    args = parse_operator_args(operator_container(docs))
    assert args.autoscaler == "keda" and args.prometheus_address == "http://prom.monitoring.svc:9090"
    assert parse_operator_args(operator_container(helm_template())).pod_monitor_labels == []
    docs = helm_template(
        "--set", "prometheus.podMonitorLabels.release=kps", "--set", "prometheus.podMonitorLabels.a\\.b/c=d"
    )
    assert parse_operator_args(operator_container(docs)).pod_monitor_labels == [("a.b/c", "d"), ("release", "kps")]
    # --set makes 1 a number and true a boolean: both are label values, passed on as text
    docs = helm_template(
        "--set", "prometheus.podMonitorLabels.release=1", "--set", "prometheus.podMonitorLabels.on=true"
    )
    assert parse_operator_args(operator_container(docs)).pod_monitor_labels == [("on", "true"), ("release", "1")]


def test_pod_monitor_labels_of_the_operator_are_refused():
    parser = add_operator_args(argparse.ArgumentParser())
    for bad in ("release", "=x", "app.kubernetes.io/name=other"):
        with pytest.raises(SystemExit):
            parser.parse_args([f"--pod-monitor-label={bad}"])


def test_cluster_wide_with_watch_namespaces_is_refused(helm):
    with pytest.raises(HelmError, match="leave watchNamespaces empty"):
        run_helm(helm, "template", "rel", str(CHART_DIR), "--set", "clusterWide=true", "--set", "watchNamespaces={ml}")


def test_leader_election_rights_are_the_lease_in_the_release_namespace(helm_template):
    for flags in ((), CLUSTER_WIDE, ("--set", "watchNamespaces={ml}")):
        docs = helm_template(*flags)
        (lease,) = roles(docs)["lease"]
        assert lease["metadata"]["namespace"] == "pagedllm-system" and rules_of(lease) == LEASE_RULES
        bindings = [b for b in by_kind(docs)["RoleBinding"] if b["roleRef"]["name"] == lease["metadata"]["name"]]
        assert len(bindings) == 1 and bindings[0]["metadata"]["namespace"] == "pagedllm-system"


def test_keda_rbac_only_with_keda(helm_template):
    (role,) = by_kind(helm_template("--set", "autoscaler=keda", *CLUSTER_WIDE))["ClusterRole"]
    assert rules_of(role) == NAMESPACED_RULES | KEDA_RULES | CRD_WATCH
    for role in roles(helm_template("--set", "autoscaler=keda", "--set", "watchNamespaces={ml}"))["serving"]:
        assert rules_of(role) == NAMESPACED_RULES | KEDA_RULES


def test_hpa_mode_may_still_read_and_delete_scaled_objects(helm_template):
    """Where KEDA is installed, the operator in hpa mode looks for a ScaledObject it made before a
    switch from keda (and deletes it): without the read, every resource would be Degraded (403)."""
    from pagedllm.operator.apply import PRUNABLE

    assert ("keda.sh/v1alpha1", "ScaledObject") in PRUNABLE
    (role,) = roles(helm_template())["serving"]
    scaled = {verb for group, resource, verb in rules_of(role) if resource == "scaledobjects"}
    assert scaled == {"get", "delete"}


NAMESPACED_RULES = (
    {("pagedllm.dev", "pagedllms", v) for v in ("get", "list", "watch", "patch")}
    | {("pagedllm.dev", "pagedllms/status", "patch")}
    | {("pagedllm.dev", "pagedllms/finalizers", "update")}
    | {("policy", "poddisruptionbudgets", v) for v in ("get", "create", "patch", "delete")}
    | {("networking.k8s.io", "networkpolicies", v) for v in ("get", "list", "watch", "create", "patch", "delete")}
    | {("autoscaling", "horizontalpodautoscalers", v) for v in ("get", "list", "watch", "create", "patch", "delete")}
    | {
        ("inference.networking.k8s.io", "inferencepools", v)
        for v in ("get", "list", "watch", "create", "patch", "delete")
    }
    | {("discovery.k8s.io", "endpointslices", v) for v in ("list", "watch")}
    | {("monitoring.coreos.com", "podmonitors", v) for v in ("get", "create", "patch", "delete")}
    | {("keda.sh", "scaledobjects", v) for v in ("get", "delete")}
    | {("apps", "deployments", v) for v in ("get", "list", "watch", "create", "patch", "delete")}
    | {("leaderworkerset.x-k8s.io", "leaderworkersets", v) for v in ("get", "list", "watch", "create", "patch")}
    | {("leaderworkerset.x-k8s.io", "leaderworkersets", "delete")}
    | {("", "services", v) for v in ("get", "list", "watch", "create", "patch")}
    | {("", "pods", v) for v in ("list", "watch")}
    | {("", "persistentvolumeclaims", v) for v in ("get", "create", "patch")}
    | {("batch", "jobs", v) for v in ("get", "list", "watch", "create", "patch")}
    | {("", "events", "create")}
    | {("", kind, v) for kind in ("serviceaccounts", "configmaps") for v in ("get", "create", "patch")}
    | {("rbac.authorization.k8s.io", kind, v) for kind in ("roles", "rolebindings") for v in ("get", "create", "patch")}
    | {("", "pods", "get")}
    # the adapters ConfigMap; apiKeySecret for adapter loads; the HTTP add-on's NAME-http and HTTPScaledObject
    | {("", "configmaps", "delete"), ("", "secrets", "get"), ("", "services", "delete")}
    | {("http.keda.sh", "httpscaledobjects", v) for v in ("get", "delete")}
    | {
        ("inference.networking.x-k8s.io", kind, v)
        for kind in ("inferenceobjectives", "inferencemodelrewrites")
        for v in ("get", "list", "watch")
    }
)
CRD_WATCH = {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")}


def test_rbac_is_minimal_cluster_wide(helm_template):
    docs = helm_template(*CLUSTER_WIDE)
    (role,) = by_kind(docs)["ClusterRole"]
    assert rules_of(role) == NAMESPACED_RULES | CRD_WATCH
    assert roles(docs)["serving"] == []


def test_rbac_by_default_is_the_release_namespace_only(helm_template):
    docs = helm_template()
    (cluster_role,) = by_kind(docs)["ClusterRole"]
    assert rules_of(cluster_role) == CRD_WATCH | {("", "namespaces", "list"), ("", "namespaces", "watch")}
    (role,) = roles(docs)["serving"]
    assert role["metadata"]["namespace"] == "pagedllm-system" and rules_of(role) == NAMESPACED_RULES


def test_rbac_per_namespace(helm_template):
    kinds = by_kind(helm_template("--set", "watchNamespaces={ml,research}"))
    (cluster_role,) = kinds["ClusterRole"]
    assert rules_of(cluster_role) == CRD_WATCH | {("", "namespaces", "list"), ("", "namespaces", "watch")}
    serving = roles(helm_template("--set", "watchNamespaces={ml,research}"))["serving"]
    assert sorted(r["metadata"]["namespace"] for r in serving) == ["ml", "research"]
    bindings = [b for b in kinds["RoleBinding"] if not b["metadata"]["name"].endswith("-leader-election")]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["ml", "research"]
    for role in serving:
        assert rules_of(role) == NAMESPACED_RULES


# What the operator may delete: the fleet objects a spec stops asking for. Never the
# Deployment, Service, claim (downloaded weights) or anyone's PagedLLM.
DELETABLE = {"poddisruptionbudgets", "horizontalpodautoscalers", "scaledobjects", "inferencepools", "podmonitors"}
# The server pods' owner switches kind with spec.nodes: the one no longer rendered is deleted (if the operator's).
DELETABLE |= {"deployments", "leaderworkersets"}
# A resource's NetworkPolicies, when its spec (or the Job they fence) no longer asks for them.
DELETABLE |= {"networkpolicies"}
# The LoRA adapter list, when LoRA is turned off; the HTTP add-on's objects (NAME-http, the HTTPScaledObject)
# when a model no longer scales from zero.
DELETABLE |= {"configmaps", "services", "httpscaledobjects"}


def test_no_wildcards_and_deletes_only_of_fleet_objects(helm_template):
    for flags in ((), ("--set", "watchNamespaces={ml}"), ("--set", "autoscaler=keda"), CLUSTER_WIDE):
        for doc in helm_template(*flags):
            if doc["kind"] in RBAC_KINDS or doc["kind"] == "ClusterRole":
                for group, resource, verb in rules_of(doc):
                    assert "*" not in (group, resource, verb) and verb != "deletecollection"
                    assert verb != "delete" or resource in DELETABLE, (group, resource)


@pytest.mark.parametrize("flags", SWITCHES)
def test_rendered_manifests_validate_offline(helm_template, flags, monkeypatch):
    docs = helm_template(*flags)

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30", strict=True)


@pytest.mark.parametrize(
    "flag, value",
    [
        ("operator.logLevel", "loud"),
        ("image.pullPolicy", "Sometimes"),
        ("servingImage", "reg/serve:9"),
        ("crds.install", "maybe"),
        ("unknownKey", "1"),
        ("autoscaler", "kpa"),
        ("prometheus.address", "prometheus:9090"),
        ("prometheus.podMonitorLabels", "release"),
        ("networkPolicy.enabled", "maybe"),
        ("networkPolicy.allowNamespaces", "Not_A_Namespace"),
    ],
)
def test_values_schema_refuses_bad_values(helm, flag, value):
    with pytest.raises(HelmError, match="values don't meet the specifications|schema"):
        run_helm(helm, "template", "rel", str(CHART_DIR), "--set", f"{flag}={value}")


def test_values_schema_covers_and_accepts_the_defaults():
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    jsonschema.validate(values, schema)
    assert set(values) <= set(schema["properties"])


def test_every_value_is_documented():
    """Each key of values.yaml has a comment right above it, or sits under a key that has one."""
    documented_at: list[int] = []  # indents of documented ancestors
    undocumented = []
    previous = ""
    for line in (CHART_DIR / "values.yaml").read_text().splitlines():
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if match:
            indent = len(match.group(1))
            documented_at = [i for i in documented_at if i < indent]
            if previous.strip().startswith("#"):
                documented_at.append(indent)
            elif not documented_at:
                # a grouping key (image:, crds:, ...) is documented through its children
                if line.rstrip().endswith(":"):
                    pass
                else:
                    undocumented.append(line.strip())
        if line.strip():
            previous = line
    assert not undocumented, undocumented


def test_notes_show_a_valid_first_resource_and_how_to_call_it(helm, tmp_path):
    out = run_helm(helm, "install", "--dry-run=client", "rel", str(CHART_DIR), "--namespace", "pagedllm-system")
    notes = out[out.index("NOTES:") :]
    assert "curl" in notes and "/v1/completions" in notes and "kubectl get pagedllms" in notes
    manifest = textwrap.dedent(notes.split("<<'YAML' | kubectl apply -f -\n", 1)[1].split("  YAML\n", 1)[0])
    resource = yaml.safe_load(manifest)
    assert resource["kind"] == "PagedLLM" and resource["apiVersion"] == "pagedllm.dev/v1alpha1"
    PagedLLMSpec.from_dict(resource["spec"])


def test_prometheus_adapter_rules_serve_every_autoscaling_metric_under_its_own_name(helm_template):
    import re as regex

    from pagedllm.operator.autoscaling import METRIC_SERIES

    assert "ConfigMap" not in by_kind(helm_template())
    docs = helm_template(
        "--set", "prometheusAdapter.rules.create=true", "--set", "prometheusAdapter.namespace=monitoring"
    )
    (config_map,) = by_kind(docs)["ConfigMap"]
    assert config_map["metadata"]["namespace"] == "monitoring"
    (rule,) = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    # The adapter's discovery: which series the rule selects, and the name each is served as.
    selector = regex.search(r'__name__=~"([^"]+)"', rule["seriesQuery"]).group(1)
    for series in METRIC_SERIES.values():
        assert regex.fullmatch(selector, series), series
        served = regex.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
        assert served == series  # the HPA asks for the series' own name
    assert not regex.fullmatch(selector, "vllm:num_requests_waiting")
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert "<<.Series>>{<<.LabelMatchers>>}" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]


def admission(docs: list[dict], obj: dict) -> list[str]:
    """The messages of the rendered ValidatingAdmissionPolicy's validations ``obj`` fails (celpy)."""
    import celpy

    (policy,) = by_kind(docs)["ValidatingAdmissionPolicy"]
    env = celpy.Environment()

    def run(expression: str, activation: dict):
        return env.program(env.compile(expression)).evaluate(activation)

    subject = {"object": celpy.json_to_cel(obj)}
    variables = {v["name"]: run(v["expression"], subject) for v in policy["spec"]["variables"]}
    activation = {
        **subject,
        "variables": celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in variables.items()}),
    }
    return [
        str(run(check["messageExpression"], activation))
        for check in policy["spec"]["validations"]
        if not run(check["expression"], activation)
    ]


def test_admission_policy_refuses_what_the_operator_refuses(helm_template):
    from pagedllm.operator.policy import AdminPolicy
    from pagedllm.operator.spec import PagedLLMSpec

    lists = {
        "allowedImages": ["ghcr.io/pagedllm/*", "mirror.example/epp:v1.0.1"],
        "allowedServiceAccounts": ["llm"],
        "allowedRuntimeClasses": ["nvidia"],
    }
    flags = ["--set", "policy.admissionPolicy=true", "--set", "endpointPicker.image=mirror.example/epp:v1.0.1"]
    for key, values in lists.items():
        flags += ["--set", f"policy.{key}={{{','.join(values)}}}"]
    docs = helm_template(*flags)
    operator = AdminPolicy(images=tuple(lists["allowedImages"]), service_accounts=("llm",), runtime_classes=("nvidia",))
    picker = {"inferencePool": True, "endpointPicker": {"deploy": True}}
    cases = [
        ({}, []),
        ({"image": "ghcr.io/pagedllm/pagedllm:dev", "serviceAccountName": "llm", "runtimeClassName": "nvidia"}, []),
        ({"image": "docker.io/x/y:1"}, ["spec.image=docker.io/x/y:1"]),
        ({"serviceAccountName": "admin"}, ["spec.serviceAccountName=admin"]),
        ({"serviceAccountName": "default"}, []),
        ({"runtimeClassName": "kata"}, ["spec.runtimeClassName=kata"]),
        ({"routing": picker}, []),
        (
            {"routing": {**picker, "endpointPicker": {"deploy": True, "image": "evil/epp:1"}}},
            ["spec.routing.endpointPicker.image=evil/epp:1"],
        ),
        ({"routing": {"inferencePool": True, "endpointPicker": {"image": "evil/epp:1"}}}, []),  # not deployed
    ]
    for spec, refused in cases:
        obj = {"apiVersion": "pagedllm.dev/v1alpha1", "kind": "PagedLLM", "spec": {"model": "org/m", **spec}}
        messages = admission(docs, obj)
        assert [m.split(" is not allowed")[0] for m in messages] == refused, (spec, messages)
        assert all("allowed are [" in m for m in messages)
        problem = operator.check(
            PagedLLMSpec.from_dict(obj["spec"]), "ghcr.io/pagedllm/pagedllm:0.1.0", "mirror.example/epp:v1.0.1"
        )
        assert (problem is not None) == bool(refused), spec  # the operator agrees
    (binding,) = by_kind(docs)["ValidatingAdmissionPolicyBinding"]
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0]["values"] == [
        "pagedllm-system"
    ]
    (binding,) = by_kind(helm_template(*flags, "--set", "clusterWide=true"))["ValidatingAdmissionPolicyBinding"]
    assert "matchResources" not in binding["spec"]
    assert "ValidatingAdmissionPolicy" not in by_kind(helm_template())


def test_admission_policy_refuses_foreign_service_accounts_without_a_list(helm_template):
    from pagedllm.operator.policy import AdminPolicy
    from pagedllm.operator.spec import PagedLLMSpec

    docs = helm_template("--set", "policy.admissionPolicy=true")
    for account, refused in (("default", []), ("cloud-admin", ["spec.serviceAccountName=cloud-admin"])):
        spec = {"model": "org/m", "serviceAccountName": account}
        messages = admission(docs, {"apiVersion": "pagedllm.dev/v1alpha1", "kind": "PagedLLM", "spec": spec})
        assert [m.split(" is not allowed")[0] for m in messages] == refused
        assert all(m.endswith('allowed are ["default"]') for m in messages), messages
        problem = AdminPolicy().check(PagedLLMSpec.from_dict(spec), "img", "epp")
        assert (problem is not None) == bool(refused)  # the operator agrees


def test_network_policies_are_on_by_default_and_the_switch_reaches_the_operator(helm_template):
    assert parse_operator_args(operator_container(helm_template())).network_policies is True
    off = operator_container(helm_template("--set", "networkPolicy.enabled=false"))
    assert "--no-network-policies" in off["args"]
    assert parse_operator_args(off).network_policies is False
    # Prometheus's namespace (prometheus.address's) may scrape the servers by default.
    assert parse_operator_args(operator_container(helm_template())).network_policy_namespaces == ["monitoring"]
    docs = helm_template("--set", "networkPolicy.allowNamespaces={monitoring,gateway-system}")
    assert parse_operator_args(operator_container(docs)).network_policy_namespaces == ["monitoring", "gateway-system"]


def test_policy_lists_reach_the_operator(helm_template):
    docs = helm_template(
        "--set", "policy.allowedImages={ghcr.io/pagedllm/*}", "--set", "policy.allowedPriorityClasses={inference}"
    )
    args = parse_operator_args(operator_container(docs))
    assert args.allowed_image == ["ghcr.io/pagedllm/*"] and args.allowed_priority_class == ["inference"]
    assert args.allowed_service_account == [] and args.allowed_runtime_class == []


def test_the_operator_pods_carry_the_label_the_server_policies_admit(helm_template):
    from pagedllm.operator.network_policy import OPERATOR_POD_LABELS

    docs = helm_template()
    (deployment,) = by_kind(docs)["Deployment"]
    assert OPERATOR_POD_LABELS.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert parse_operator_args(operator_container(docs)).operator_namespace == "pagedllm-system"


def test_operator_replicas_spread_and_are_drained_one_at_a_time(helm_template):
    docs = helm_template()
    (deployment,) = by_kind(docs)["Deployment"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert deployment["spec"]["replicas"] == 2
    terms = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    keys = [t["podAffinityTerm"]["topologyKey"] for t in terms]
    assert keys == ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]
    assert all(t["podAffinityTerm"]["labelSelector"]["matchLabels"] == selector for t in terms)
    (budget,) = by_kind(docs)["PodDisruptionBudget"]
    assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}

    single = by_kind(helm_template("--set", "replicas=1"))
    assert "PodDisruptionBudget" not in single
    assert "affinity" not in single["Deployment"][0]["spec"]["template"]["spec"]
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    custom = by_kind(helm_template("--set-json", f"affinity={json.dumps(own)}"))["Deployment"][0]
    assert custom["spec"]["template"]["spec"]["affinity"] == own  # the values' affinity replaces the default


def test_the_keda_http_add_on_is_wired_only_with_keda(helm_template):
    flags = ("--set", "autoscaler=keda", "--set", "kedaHttpAddOn.enabled=true")
    docs = helm_template(*flags)
    args = parse_operator_args(operator_container(docs))
    assert args.keda_http_interceptor == "keda-add-ons-http-interceptor-proxy.keda:8080"
    assert "keda" in args.network_policy_namespaces
    (role,) = roles(docs)["serving"]
    http = {verb for group, resource, verb in rules_of(role) if resource == "httpscaledobjects"}
    assert http == {"get", "create", "patch", "delete"}
    hpa = parse_operator_args(operator_container(helm_template("--set", "kedaHttpAddOn.enabled=true")))
    assert hpa.keda_http_interceptor is None  # the add-on scales through KEDA
