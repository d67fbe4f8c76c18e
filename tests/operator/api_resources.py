"""The kinds the emulated API server serves, and where the tests' client finds them.

:data:`RESOURCE_INFOS` are served from the start (kmock's discovery answers them);
:data:`OPTIONAL_RESOURCE_INFOS` only once a test installs them, as installing their CRDs
would. :data:`STEM` maps the kinds the operator names only through discovery to their
API prefix and plural, and :data:`RBAC_VERBS` kmock's action names to RBAC verbs.
"""

from __future__ import annotations

import kmock

RESOURCE_INFOS = {
    "pagedllm.dev/v1alpha1/pagedllms": kmock.ResourceInfo(
        kind="PagedLLM",
        singular="pagedllm",
        namespaced=True,
        shortnames={"pllm"},
        subresources={"status", "scale"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "apps/v1/deployments": kmock.ResourceInfo(
        kind="Deployment",
        singular="deployment",
        namespaced=True,
        subresources={"status", "scale"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "v1/services": kmock.ResourceInfo(
        kind="Service",
        singular="service",
        namespaced=True,
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "policy/v1/poddisruptionbudgets": kmock.ResourceInfo(
        kind="PodDisruptionBudget",
        singular="poddisruptionbudget",
        namespaced=True,
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "autoscaling/v2/horizontalpodautoscalers": kmock.ResourceInfo(
        kind="HorizontalPodAutoscaler",
        singular="horizontalpodautoscaler",
        namespaced=True,
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "v1/pods": kmock.ResourceInfo(
        kind="Pod",
        singular="pod",
        namespaced=True,
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "batch/v1/jobs": kmock.ResourceInfo(
        kind="Job",
        singular="job",
        namespaced=True,
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "discovery.k8s.io/v1/endpointslices": kmock.ResourceInfo(
        kind="EndpointSlice",
        singular="endpointslice",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "v1/serviceaccounts": kmock.ResourceInfo(
        kind="ServiceAccount",
        singular="serviceaccount",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "v1/secrets": kmock.ResourceInfo(
        kind="Secret",
        singular="secret",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "v1/configmaps": kmock.ResourceInfo(
        kind="ConfigMap",
        singular="configmap",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "rbac.authorization.k8s.io/v1/roles": kmock.ResourceInfo(
        kind="Role",
        singular="role",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "rbac.authorization.k8s.io/v1/rolebindings": kmock.ResourceInfo(
        kind="RoleBinding",
        singular="rolebinding",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "networking.k8s.io/v1/networkpolicies": kmock.ResourceInfo(
        kind="NetworkPolicy",
        singular="networkpolicy",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "coordination.k8s.io/v1/leases": kmock.ResourceInfo(
        kind="Lease",
        singular="lease",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "v1/persistentvolumeclaims": kmock.ResourceInfo(
        kind="PersistentVolumeClaim",
        singular="persistentvolumeclaim",
        namespaced=True,
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    # NOTE: kopf waits to discover namespaces before it starts any watch, even cluster-wide
    # (where it never lists them; listing them from kmock fails).
    "v1/namespaces": kmock.ResourceInfo(
        kind="Namespace", singular="namespace", namespaced=False, verbs={"get", "list", "watch"}
    ),
    "v1/events": kmock.ResourceInfo(
        kind="Event", singular="event", namespaced=True, verbs={"get", "list", "watch", "create", "patch"}
    ),
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        kind="CustomResourceDefinition",
        singular="customresourcedefinition",
        namespaced=False,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
}

# Kinds of optional CRDs (KEDA, Gateway API Inference Extension, Prometheus Operator, LeaderWorkerSet): served
# only by clusters that install them (:meth:`EmulatedCluster.install`).
_OPTIONAL_KINDS = (
    ("keda.sh/v1alpha1", "scaledobjects", "ScaledObject"),
    ("inference.networking.k8s.io/v1", "inferencepools", "InferencePool"),
    ("monitoring.coreos.com/v1", "podmonitors", "PodMonitor"),
    ("leaderworkerset.x-k8s.io/v1", "leaderworkersets", "LeaderWorkerSet"),
)
OPTIONAL_RESOURCE_INFOS = {
    f"{group_version}/{plural}": kmock.ResourceInfo(
        kind=kind,
        singular=plural[:-1],
        namespaced=True,
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    )
    for group_version, plural, kind in _OPTIONAL_KINDS
}

# Where the tests' client finds the kinds the operator names only through discovery.
STEM = {
    "Event": ("/api/v1", "events"),
    "Job": ("/apis/batch/v1", "jobs"),
    "EndpointSlice": ("/apis/discovery.k8s.io/v1", "endpointslices"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Secret": ("/api/v1", "secrets"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    **{kind: (f"/apis/{gv}", plural) for gv, plural, kind in _OPTIONAL_KINDS},
}

# kmock's action names -> the RBAC verbs they need.
RBAC_VERBS = {
    "list": "list",
    "watch": "watch",
    "fetch": "get",
    "create": "create",
    "update": "patch",
    "delete": "delete",
}
