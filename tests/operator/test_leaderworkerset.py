"""spec.nodes > 1: the LeaderWorkerSet that replaces the Deployment, validated against the LWS project's
own CRD schema (vendored, see schemas/leaderworkerset.x-k8s.io_leaderworkersets.yaml.gz), and its
command lines parsed by the real `pagedllm serve` parser as each pod would run them."""

from __future__ import annotations

import argparse
import functools
import gzip
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from crd_jsonschema import to_jsonschema
from resource_factories import CONFIG, body
from third_party_schemas import validate_manifest

from pagedllm.operator.leaderworkerset import LEADER_ONLY, MASTER_PORT, WORKER_INDEX_LABEL
from pagedllm.operator.manifests import render, selector_labels
from pagedllm.operator.spec import SpecError
from pagedllm.server.args import engine_config_from_args
from pagedllm.server.entrypoints.cli import build_parser
from pagedllm.server.entrypoints.headless import check_node_role

LWS_CRD = Path(__file__).parent / "schemas" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml.gz"
SCALING = {"minReplicas": 1, "maxReplicas": 4, "metric": "queue", "target": 4}


@functools.cache
def lws_validator() -> jsonschema.Draft202012Validator:
    crd = yaml.safe_load(gzip.open(LWS_CRD))
    assert crd["metadata"]["name"] == "leaderworkersets.leaderworkerset.x-k8s.io"
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1"
    schema = to_jsonschema(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def lws_of(**spec) -> dict:
    workload = render(body(**spec), CONFIG).deployment
    assert workload["kind"] == "LeaderWorkerSet"
    return workload


def containers(lws: dict) -> tuple[dict, dict]:
    template = lws["spec"]["leaderWorkerTemplate"]
    return template["leaderTemplate"]["spec"]["containers"][0], template["workerTemplate"]["spec"]["containers"][0]


def as_run(args: list[str], env: dict[str, str]) -> list[str]:
    """The arguments as the kubelet hands them over: $(VAR) replaced from the container's environment."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in args]


@pytest.mark.parametrize(
    "spec",
    [
        dict(nodes=2, tensorParallelSize=8, replicas=2),
        dict(nodes=4, tensorParallelSize=2, rolloutStrategy="Recreate"),
        dict(nodes=2, tensorParallelSize=4, autoscaling=SCALING, routing={"inferencePool": True}),
    ],
)
def test_the_leaderworkerset_fits_the_lws_crd_schema(spec):
    lws = lws_of(**spec)
    errors = sorted(lws_validator().iter_errors(lws), key=str)
    assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors[:5]]
    for template in ("leaderTemplate", "workerTemplate"):  # the pods, against Kubernetes' own PodSpec schema
        pod_template = lws["spec"]["leaderWorkerTemplate"][template]
        validate_manifest(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": pod_template}
        )


def test_a_group_spans_nodes_with_gpus_per_pod_and_one_restart_policy():
    lws = lws_of(nodes=2, tensorParallelSize=8, replicas=3)
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["spec"]["replicas"] == 3
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    leader, worker = containers(lws)
    for container in (leader, worker):
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert container["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert "readinessProbe" in leader and "startupProbe" in leader
    assert not {"readinessProbe", "startupProbe", "livenessProbe", "ports"} & worker.keys()
    assert {"name": "tp", "containerPort": MASTER_PORT, "protocol": "TCP"} in leader["ports"]


def test_each_pod_runs_its_part_of_one_engine():
    """Leader and worker command lines, with LWS's environment filled in, parse with `pagedllm serve`
    into one tensor-parallel layout: the whole group's size, the leader's address, each pod's node."""
    lws = lws_of(nodes=2, tensorParallelSize=4)
    leader, worker = containers(lws)
    configs = []
    for container, index, headless in ((leader, "0", False), (worker, "1", True)):
        env = {"LWS_LEADER_ADDRESS": "llama-0.llama.ml", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": index}
        args = build_parser().parse_args(["serve", *as_run(container["args"], env)])
        assert isinstance(args, argparse.Namespace) and args.headless is headless
        config = engine_config_from_args(args)
        check_node_role(config, args.headless)
        configs.append(config.parallel)
    assert [p.node_rank for p in configs] == [0, 1]
    for parallel in configs:
        assert (parallel.tensor_parallel_size, parallel.nnodes) == (8, 2)
        assert (parallel.master_addr, parallel.master_port) == ("llama-0.llama.ml", MASTER_PORT)


def test_clients_and_fleet_objects_reach_only_leaders():
    m = render(body(nodes=2, tensorParallelSize=2, autoscaling=SCALING, routing={"inferencePool": True}), CONFIG)
    leaders = {**selector_labels("llama"), WORKER_INDEX_LABEL: "0"}
    assert m.service["spec"]["selector"] == leaders
    assert LEADER_ONLY == {WORKER_INDEX_LABEL: "0"}
    fleet = m.fleet
    assert fleet is not None and fleet.inference_pool is not None and fleet.autoscaler is not None
    assert fleet.inference_pool["spec"]["selector"]["matchLabels"] == leaders
    assert fleet.pod_monitor["spec"]["selector"]["matchLabels"] == leaders
    assert fleet.disruption_budget is not None
    # every pod of every group, one pod (so one group) at a time
    assert fleet.disruption_budget["spec"] == {
        "selector": {"matchLabels": selector_labels("llama")},
        "maxUnavailable": 1,
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    }
    target = fleet.autoscaler["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        "leaderworkerset.x-k8s.io/v1",
        "LeaderWorkerSet",
        "llama",
    )
    assert "replicas" not in m.deployment["spec"]  # the autoscaler owns the count


def test_rollouts_go_through_the_lws_rollout_strategy():
    rolling = lws_of(nodes=2, rollout={"maxSurge": 1, "maxUnavailable": 0})["spec"]["rolloutStrategy"]
    assert rolling == {"type": "RollingUpdate", "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1}}
    fleet = lws_of(nodes=2, replicas=3)["spec"]["rolloutStrategy"]  # a fleet's default: no spare GPUs
    assert fleet["rollingUpdateConfiguration"] == {"maxUnavailable": 1, "maxSurge": 0}
    recreate = lws_of(nodes=2)["spec"]["rolloutStrategy"]  # one replica: Recreate, as for the Deployment
    assert recreate["rollingUpdateConfiguration"] == {"maxUnavailable": "100%", "maxSurge": 0}


def test_one_node_stays_a_deployment():
    m = render(body(tensorParallelSize=2), CONFIG)
    assert m.deployment["kind"] == "Deployment"
    assert WORKER_INDEX_LABEL not in m.service["spec"]["selector"]


def test_too_many_ranks_are_refused():
    with pytest.raises(SpecError, match=r"spec.nodes=16 is not allowed: .* at most 64 ranks \(here 128\)"):
        render(body(nodes=16, tensorParallelSize=8), CONFIG)


def test_the_schema_check_catches_mistakes():
    lws = lws_of(nodes=2)
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroupOnPodRestarts"
    lws["spec"]["leaderWorkerTemplate"]["sizes"] = 2
    messages = [e.message for e in lws_validator().iter_errors(lws)]
    assert any("RecreateGroupOnPodRestarts" in m for m in messages), messages
    assert any("'sizes' was unexpected" in m for m in messages), messages


def test_groups_are_placed_exclusively_unless_opted_out():
    m = render(body(nodes=2, tensorParallelSize=2), CONFIG)
    annotations = m.deployment["metadata"]["annotations"]
    assert annotations["leaderworkerset.sigs.k8s.io/exclusive-topology"] == "topology.kubernetes.io/zone"
    pool = render(body(nodes=2, groupPlacement={"topologyKey": "cloud.google.com/gke-nodepool"}), CONFIG)
    assert pool.deployment["metadata"]["annotations"]["leaderworkerset.sigs.k8s.io/exclusive-topology"] == (
        "cloud.google.com/gke-nodepool"
    )
    off = render(body(nodes=2, groupPlacement={"exclusiveTopology": False}), CONFIG)
    assert "leaderworkerset.sigs.k8s.io/exclusive-topology" not in off.deployment["metadata"]["annotations"]
    single = render(body(groupPlacement={"topologyKey": "x/y"}), CONFIG)  # a Deployment: nothing to place
    assert "leaderworkerset.sigs.k8s.io/exclusive-topology" not in single.deployment["metadata"]["annotations"]


def test_the_group_budget_admits_one_group_at_a_time():
    """The disruption controller's arithmetic over 2 groups of 2 pods: an eviction needs every pod healthy."""
    budget = render(body(nodes=2, replicas=2), CONFIG).fleet.disruption_budget["spec"]

    def allowed(healthy: int, expected: int = 4) -> int:
        return max(0, budget["maxUnavailable"] - (expected - healthy))

    assert allowed(4) == 1  # all groups whole: one pod (any, a worker too) may go
    assert allowed(2) == 0  # its group is being recreated (both pods down): no other eviction
    assert allowed(3) == 0  # even one pod of a group not ready: none
