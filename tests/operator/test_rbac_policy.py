"""The emulated API server authorizes the operator as the chart's roles would (403 otherwise)."""

from __future__ import annotations

import pytest
from k8s_emulator import OPERATOR_TOKEN, Client, EmulatedCluster
from rbac_policy import Attributes, RbacPolicy

NS = "pagedllm-system"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def attrs(verb, group, resource, namespace="ml", name=None) -> Attributes:
    return Attributes(verb, group, resource, namespace, name)


def test_cluster_wide_chart_grants_the_operator_s_calls_and_nothing_more(chart_policy):
    policy = chart_policy()
    assert policy.allows(attrs("patch", "apps", "deployments", name="llama"))
    assert policy.allows(attrs("patch", "pagedllm.dev", "pagedllms/status", name="llama"))
    assert policy.allows(attrs("watch", "pagedllm.dev", "pagedllms", namespace=None))
    assert policy.allows(attrs("create", "", "events"))
    assert not policy.allows(attrs("delete", "pagedllm.dev", "pagedllms", name="llama"))
    assert not policy.allows(attrs("delete", "apiextensions.k8s.io", "customresourcedefinitions", None, "x"))
    assert not policy.allows(attrs("create", "", "secrets"))
    assert not policy.allows(attrs("patch", "apps", "deployments/scale", name="llama"))
    # The Lease only in the release namespace.
    assert policy.allows(attrs("create", "coordination.k8s.io", "leases", NS))
    assert not policy.allows(attrs("create", "coordination.k8s.io", "leases", "ml"))


def test_namespaced_chart_grants_only_the_watched_namespaces(helm_template):
    policy = RbacPolicy.of_chart(helm_template("--set", "watchNamespaces={ml}"), NS)
    assert policy.allows(attrs("patch", "apps", "deployments", "ml", "llama"))
    assert not policy.allows(attrs("patch", "apps", "deployments", "other", "llama"))
    assert not policy.allows(attrs("watch", "apps", "deployments", None))  # cluster-wide watch


def test_rule_matching_wildcards_and_resource_names():
    docs = [
        {"kind": "ServiceAccount", "metadata": {"name": "op", "namespace": NS}},
        {"kind": "ClusterRole", "metadata": {"name": "r"}, "rules": [
            {"apiGroups": ["*"], "resources": ["*/status"], "verbs": ["patch"]},
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["*"], "resourceNames": ["one"]},
        ]},
        {"kind": "ClusterRoleBinding", "metadata": {"name": "b"}, "roleRef": {"kind": "ClusterRole", "name": "r"},
         "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": NS}]},
        {"kind": "ClusterRoleBinding", "metadata": {"name": "other"}, "roleRef": {"kind": "ClusterRole", "name": "r"},
         "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": "elsewhere"}]},
    ]  # fmt: skip
    policy = RbacPolicy.of_chart(docs, NS)
    assert policy.allows(attrs("patch", "apps", "deployments/status"))
    assert not policy.allows(attrs("patch", "apps", "deployments"))
    assert policy.allows(attrs("get", "", "configmaps", name="one"))
    assert not policy.allows(attrs("get", "", "configmaps", name="two"))
    assert not policy.allows(attrs("list", "", "configmaps"))  # names no object
    assert not RbacPolicy(docs, "elsewhere", "nobody").allows(attrs("patch", "apps", "deployments/status"))


@pytest.fixture()
def bare_cluster(chart_policy):
    emulated = EmulatedCluster(chart_policy()).start()
    yield emulated
    emulated.stop()


def test_the_operator_s_requests_the_chart_does_not_allow_are_403(bare_cluster):
    operator, admin = Client(bare_cluster.url, OPERATOR_TOKEN), Client(bare_cluster.url)
    status, body = operator.request("DELETE", f"{CRDS}/pagedllms.pagedllm.dev")
    assert (status, body["reason"]) == (403, "Forbidden")
    assert 'cannot delete resource "customresourcedefinitions"' in body["message"]
    assert body["message"].startswith('customresourcedefinitions.apiextensions.k8s.io "pagedllms.pagedllm.dev"')
    status, _ = operator.request("POST", "/api/v1/namespaces/ml/secrets", {"metadata": {"name": "s"}})
    assert status == 403
    assert len(bare_cluster.denials()) == 2
    # The tests' own client is an admin; discovery is open to the operator.
    assert admin.request("GET", "/api/v1/namespaces/ml/secrets")[0] == 200
    assert operator.request("GET", "/apis/apps/v1")[0] == 200


def test_an_apply_that_creates_needs_create_too(chart_policy):
    docs_policy = chart_policy()
    # The same chart less the right to create Services: applying one that exists still works.
    for rule in docs_policy.cluster_rules:
        if rule["apiGroups"] == [""] and "services" in rule["resources"]:
            rule["verbs"] = [v for v in rule["verbs"] if v != "create"]
    emulated = EmulatedCluster(docs_policy).start()
    try:
        operator, admin = Client(emulated.url, OPERATOR_TOKEN), Client(emulated.url)
        path = "/api/v1/namespaces/ml/services/llama?fieldManager=op"
        body = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "llama"}, "spec": {"ports": [{"port": 80}]}}
        assert operator.request("PATCH", path, body, "application/apply-patch+yaml")[0] == 403
        assert admin.request("PATCH", path, body, "application/apply-patch+yaml")[0] == 200
        assert operator.request("PATCH", path, body, "application/apply-patch+yaml")[0] == 200
    finally:
        emulated.stop()
