"""The Deployment strategy a spec renders to (operator/rollout.py), through render()."""

from __future__ import annotations

import pytest
from resource_factories import CONFIG, body

from pagedllm.operator.manifests import render
from pagedllm.operator.rollout import Rollout, parse_rollout, plan_rollout
from pagedllm.operator.spec import SpecError

ROLL_0_1 = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
RWX = {"size": "10Gi", "accessMode": "ReadWriteMany"}


def strategy(**spec) -> dict:
    return render(body(**spec), CONFIG).deployment["spec"]["strategy"]


@pytest.mark.parametrize(
    "spec, expected",
    [
        ({}, {"type": "Recreate"}),
        ({"replicas": 1}, {"type": "Recreate"}),
        ({"replicas": 3}, ROLL_0_1),
        ({"replicas": 2, "modelCache": RWX}, ROLL_0_1),
        ({"autoscaling": {"maxReplicas": 4, "target": 2}}, ROLL_0_1),
        ({"replicas": 3, "rolloutStrategy": "RollingUpdate"}, ROLL_0_1),
        ({"replicas": 3, "rolloutStrategy": "Recreate"}, {"type": "Recreate"}),
        (
            {"rolloutStrategy": "RollingUpdate"},
            {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        ),
        (
            {"replicas": 4, "rollout": {"maxSurge": "25%"}},
            {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0}},
        ),
        (
            {"replicas": 4, "rollout": {"maxUnavailable": 2}},
            {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 2}},
        ),
        (
            {"replicas": 4, "rollout": {"maxUnavailable": "0%"}},
            {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": "0%"}},
        ),
        ({"rollout": {"maxSurge": 0}}, ROLL_0_1),
        ({"modelCache": {"size": "10Gi"}, "rollout": {"maxSurge": 0}}, ROLL_0_1),
        ({"modelCache": {"size": "10Gi"}}, {"type": "Recreate"}),
    ],
)
def test_defaults_and_overrides(spec, expected):
    assert strategy(**spec) == expected


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            {"modelCache": {"size": "10Gi"}, "rollout": {"maxSurge": 1}},
            r"spec.rollout.maxSurge=1 is not allowed with a ReadWriteOnce spec.modelCache: .*Multi-Attach",
        ),
        (
            {"modelCache": {"size": "10Gi"}, "rollout": {"maxSurge": "10%"}},
            r"maxSurge='10%' is not allowed with a ReadWriteOnce",
        ),
        (
            {"modelCache": {"size": "10Gi"}, "rolloutStrategy": "RollingUpdate"},
            r"the RollingUpdate default maxSurge=1 is not allowed with a ReadWriteOnce",
        ),
        (
            {"replicas": 2, "rollout": {"maxSurge": 0, "maxUnavailable": 0}},
            r"spec.rollout.maxSurge=0 is not allowed with maxUnavailable=0: no pod could ever be replaced",
        ),
        ({"replicas": 2, "rollout": {"maxSurge": "0%", "maxUnavailable": 0}}, r"no pod could ever be replaced"),
        (
            {"rolloutStrategy": "Recreate", "rollout": {"maxSurge": 1}},
            r"spec.rollout is not allowed with spec.rolloutStrategy='Recreate'",
        ),
        ({"rollout": {"maxSurge": -1}}, r"spec.rollout.maxSurge=-1 is not allowed: a count >= 0 or a percentage"),
        ({"rollout": {"maxUnavailable": "150%"}}, r"spec.rollout.maxUnavailable='150%' is not allowed"),
        ({"rollout": {"maxUnavailable": "1"}}, r"spec.rollout.maxUnavailable='1' is not allowed"),
        ({"rollout": {"maxUnavailable": True}}, r"spec.rollout.maxUnavailable=True is not allowed"),
        ({"rollout": {"surge": 1}}, r"spec.rollout has unknown field\(s\) \['surge'\]"),
    ],
)
def test_refusals_name_the_value_and_the_reason(spec, message):
    with pytest.raises(SpecError, match=message):
        render(body(**spec), CONFIG)


def test_plan_is_a_pure_function_of_its_inputs():
    rollout = parse_rollout("spec.rollout", {"maxSurge": 2})
    assert rollout == Rollout(max_surge=2)
    assert plan_rollout(None, rollout, fleet=True, rwo_cache=False).strategy()["rollingUpdate"] == {
        "maxSurge": 2,
        "maxUnavailable": 0,
    }
    assert plan_rollout(None, None, fleet=False, rwo_cache=True).strategy() == {"type": "Recreate"}


def test_the_crd_allows_int_or_percent(crd_schema):
    rollout = crd_schema["properties"]["spec"]["properties"]["rollout"]["properties"]
    for bound in ("maxSurge", "maxUnavailable"):
        assert rollout[bound]["x-kubernetes-int-or-string"] is True
