"""What counts as drift of a child, whose child it is, and applying each child on its own."""

from __future__ import annotations

import asyncio
import copy

from pagedllm.operator.apply import (
    ADOPTION_REFUSED,
    APPLY_REFUSED,
    HANDOVER_MANAGER,
    ApplyOutcome,
    apply_all,
    prune,
    replicas_to_hand_over,
)
from pagedllm.operator.drift import drifted, foreign_controller
from pagedllm.operator.kube import FIELD_MANAGER, ApiError
from pagedllm.operator.manifests import RenderConfig, render
from pagedllm.operator.status import Problem

CONFIG = RenderConfig(default_image="registry.example/pagedllm:test")


def resource(**spec) -> dict:
    return {
        "apiVersion": "pagedllm.dev/v1alpha1",
        "kind": "PagedLLM",
        "metadata": {"name": "llama", "namespace": "ns", "uid": "owner-uid", "generation": 1},
        "spec": {"model": "meta-llama/Llama-2-7b-hf", **spec},
    }


def as_served(manifest: dict) -> dict:
    """``manifest`` as the API server keeps it: defaults added, quantities canonical, a status."""
    live = copy.deepcopy(manifest)
    live["metadata"].update(uid="dep-uid", resourceVersion="7", managedFields=[{"manager": "pagedllm-operator"}])
    pod = live["spec"]["template"]["spec"]
    pod["dnsPolicy"] = "ClusterFirst"
    (container,) = pod["containers"]
    container["terminationMessagePath"] = "/dev/termination-log"
    container["ports"][0]["hostPort"] = None
    for part in ("requests", "limits"):
        container["resources"][part]["nvidia.com/gpu"] = "1"  # 1 -> "1"
    live["status"] = {"replicas": 1, "readyReplicas": 1}
    return live


def deployment(**spec) -> dict:
    return render(resource(**spec), CONFIG).deployment


def test_as_rendered_with_server_defaults_is_no_drift():
    assert drifted(deployment(), as_served(deployment())) == []


def test_hand_edits_of_rendered_fields_are_drift():
    live = as_served(deployment())
    live["spec"]["replicas"] = 5
    live["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else:1"
    live["spec"]["template"]["spec"]["containers"][0]["args"].append("--enforce-eager")
    assert drifted(deployment(), live) == [
        "spec.replicas",
        "spec.template.spec.containers[server]",
    ]


def test_a_removed_label_or_env_var_is_drift_but_an_added_one_is_not():
    env = [{"name": "A", "value": "1"}]
    live = as_served(deployment(env=env))
    live["metadata"]["labels"]["team"] = "ml"
    live["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "EXTRA", "value": "x"})
    assert drifted(deployment(env=env), live) == []
    del live["metadata"]["labels"]["app.kubernetes.io/managed-by"]
    assert drifted(deployment(env=env), live) == ["metadata.labels.app.kubernetes.io/managed-by"]


def test_quantities_compare_by_value():
    live = as_served(deployment(resources={"requests": {"cpu": "0.5", "memory": "1Gi"}}))
    live["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "500m"
    assert drifted(deployment(resources={"requests": {"cpu": "0.5", "memory": "1Gi"}}), live) == []


def test_foreign_controller_names_the_other_owner():
    ours = {"metadata": {"ownerReferences": [{"kind": "PagedLLM", "name": "llama", "uid": "u", "controller": True}]}}
    theirs = {"metadata": {"ownerReferences": [{"kind": "Notebook", "name": "lab", "uid": "x", "controller": True}]}}
    merely_owned = {"metadata": {"ownerReferences": [{"kind": "Notebook", "name": "lab", "uid": "x"}]}}
    assert foreign_controller(ours, "u") is None
    assert foreign_controller(None, "u") is None
    assert foreign_controller(merely_owned, "u") is None
    assert foreign_controller(theirs, "u") == "Notebook/lab"


class FakeKube:
    """Objects by kind; refusals by kind (an ApiError raised on apply)."""

    def __init__(self, live: dict | None = None, refuse: dict | None = None):
        self.live, self.refuse, self.applied, self.deleted = live or {}, refuse or {}, [], []
        self.calls: list[tuple[str, str, dict]] = []  # (kind, field manager, spec)

    async def get(self, kind, namespace, name, api_version=None):
        return self.live.get(kind)

    async def apply(self, manifest, field_manager=FIELD_MANAGER):
        if manifest["kind"] in self.refuse:
            raise self.refuse[manifest["kind"]]
        self.calls.append((manifest["kind"], field_manager, manifest["spec"]))
        if field_manager == FIELD_MANAGER:
            self.applied.append(manifest["kind"])
        return dict(manifest)


def test_an_immutable_claim_is_reported_and_the_rest_still_applied():
    manifests = render(resource(modelCache={"size": "10Gi"}), CONFIG).all()
    kube = FakeKube(refuse={"PersistentVolumeClaim": ApiError(422, "spec: Forbidden: spec is immutable")})
    outcome = asyncio.run(apply_all(manifests, kube, "owner-uid"))
    assert kube.applied == ["NetworkPolicy", "NetworkPolicy", "Job", "Service", "PodMonitor", "Deployment"]
    problem = outcome.problem()
    assert problem is not None and problem.reason == APPLY_REFUSED
    assert problem.message == "PersistentVolumeClaim llama-model-cache: spec: Forbidden: spec is immutable"


def test_a_child_of_another_controller_is_not_applied():
    other = {"metadata": {"ownerReferences": [{"kind": "Notebook", "name": "lab", "uid": "x", "controller": True}]}}
    kube = FakeKube(live={"Service": other})
    outcome = asyncio.run(apply_all(render(resource(), CONFIG).all(), kube, "owner-uid"))
    assert kube.applied == ["NetworkPolicy", "PodMonitor", "Deployment"]
    problem = outcome.problem()
    assert problem is not None and problem.reason == ADOPTION_REFUSED
    assert "Service llama already exists and is controlled by Notebook/lab" in problem.message


def test_no_credentials_or_permission_and_invalid_objects_are_refusals_not_retries():
    for status in (401, 403, 422):
        assert not ApiError(status, "no").retriable, status
    for status in (409, 429, 500, 503):
        assert ApiError(status, "later").retriable, status
    kube = FakeKube(refuse={"Deployment": ApiError(401, "Unauthorized")})
    outcome = asyncio.run(apply_all(render(resource(), CONFIG).all(), kube, "owner-uid"))
    assert outcome.transient == [] and outcome.problem() == Problem(APPLY_REFUSED, "Deployment llama: Unauthorized")


def test_transient_failures_are_kept_apart_from_refusals():
    kube = FakeKube(refuse={"Service": ApiError(429, "slow down")})
    outcome = asyncio.run(apply_all(render(resource(), CONFIG).all(), kube, "owner-uid"))
    assert outcome.problem() is None and outcome.transient == ["Service llama: HTTP 429: slow down"]
    assert list(outcome.applied) == ["NetworkPolicy llama", "PodMonitor llama", "Deployment llama"]


def owned(uid: str, owner_uid: str = "owner-uid") -> dict:
    ref = {"kind": "PagedLLM", "name": "llama", "uid": owner_uid, "controller": True}
    return {"metadata": {"uid": uid, "ownerReferences": [ref]}}


class DeletingKube(FakeKube):
    async def delete(self, kind, namespace, name, api_version, uid):
        if kind in self.refuse:
            raise self.refuse[kind]
        self.deleted.append((kind, namespace, name, uid))


def test_fleet_objects_the_spec_dropped_are_deleted_only_when_ours():
    live = {
        "HorizontalPodAutoscaler": owned("hpa-uid"),
        "InferencePool": owned("pool-uid"),
        "PodDisruptionBudget": owned("pdb-uid", owner_uid="someone-else"),
    }
    kube = DeletingKube(live=live)
    outcome = ApplyOutcome()
    asyncio.run(prune(render(resource(), CONFIG).all(), kube, "owner-uid", outcome))
    assert kube.deleted == [
        ("HorizontalPodAutoscaler", "ns", "llama", "hpa-uid"),
        ("InferencePool", "ns", "llama", "pool-uid"),
    ]
    assert outcome.deleted == ["HorizontalPodAutoscaler", "InferencePool"] and outcome.problem() is None


def test_what_the_spec_still_asks_for_is_kept():
    spec = {"autoscaling": {"maxReplicas": 3, "target": 4}, "routing": {"inferencePool": True}}
    live = {kind: owned(kind) for kind in ("HorizontalPodAutoscaler", "InferencePool", "PodDisruptionBudget")}
    kube = DeletingKube(live={**live, "PodMonitor": owned("pm")})
    asyncio.run(prune(render(resource(**spec), CONFIG).all(), kube, "owner-uid", ApplyOutcome()))
    assert kube.deleted == []


def test_a_refused_delete_is_a_problem_and_a_throttled_one_a_retry():
    live = {"HorizontalPodAutoscaler": owned("h"), "InferencePool": owned("p")}
    refuse = {"HorizontalPodAutoscaler": ApiError(403, "forbidden"), "InferencePool": ApiError(429, "slow down")}
    outcome = ApplyOutcome()
    asyncio.run(prune(render(resource(), CONFIG).all(), DeletingKube(live, refuse), "owner-uid", outcome))
    problem = outcome.problem()
    assert problem is not None and problem.message.startswith("deleting HorizontalPodAutoscaler llama: forbidden")
    assert outcome.transient == ["deleting InferencePool llama: HTTP 429: slow down"]


def applied_by_us(live: dict, *fields: str) -> dict:
    """``live`` with a managedFields entry of the operator's last apply owning ``spec.<fields>``."""
    owned = {f"f:{name}": {} for name in fields}
    entry = {"manager": FIELD_MANAGER, "operation": "Apply", "fieldsV1": {"f:spec": owned}}
    return {**live, "metadata": {**live["metadata"], "managedFields": [entry]}}


def test_turning_autoscaling_on_hands_the_replica_count_over_before_dropping_it():
    live = applied_by_us(as_served(deployment(replicas=4)), "replicas", "template")
    autoscaled = render(resource(autoscaling={"maxReplicas": 8, "target": 4}), CONFIG).all()
    kube = FakeKube(live={"Deployment": live})
    assert asyncio.run(apply_all(autoscaled, kube, "owner-uid")).problem() is None
    handover, applied = kube.calls[-2:]
    assert handover == ("Deployment", HANDOVER_MANAGER, {"replicas": 4})
    assert applied[:2] == ("Deployment", FIELD_MANAGER) and "replicas" not in applied[2]


def test_no_handover_when_the_operator_sets_or_no_longer_owns_the_replicas():
    autoscaled = deployment(autoscaling={"maxReplicas": 8, "target": 4})
    live = applied_by_us(as_served(deployment(replicas=4)), "replicas", "template")
    assert replicas_to_hand_over(autoscaled, live) == 4
    assert replicas_to_hand_over(deployment(replicas=2), live) is None  # fixed replicas: applied as is
    assert replicas_to_hand_over(autoscaled, applied_by_us(live, "template")) is None  # handed over already
    assert replicas_to_hand_over(autoscaled, None) is None  # created without replicas
