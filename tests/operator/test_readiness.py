"""Feature conditions from the fleet objects' own status: HPA, KEDA ScaledObject, InferencePool and picker."""

from __future__ import annotations

from pagedllm.operator.readiness import hpa_verdict, pool_verdict, ready_endpoints, scaled_object_verdict


def hpa(*conditions: tuple[str, str, str]) -> dict:
    conds = [{"type": t, "status": s, "reason": r, "message": f"{t} says {r}"} for t, s, r in conditions]
    return {"metadata": {"name": "llama"}, "status": {"conditions": conds} if conds else {}}


def test_an_hpa_is_ready_only_when_it_can_scale_and_reads_its_metric():
    assert hpa_verdict(hpa())[:2] == ("False", "NotReported")
    status, reason, message = hpa_verdict(
        hpa(("AbleToScale", "True", "SucceededGetScale"), ("ScalingActive", "False", "FailedGetPodsMetric"))
    )
    assert (status, reason) == ("False", "FailedGetPodsMetric")
    assert "ScalingActive says FailedGetPodsMetric" in message and "custom metrics API" in message
    blocked = hpa(("AbleToScale", "False", "FailedGetScale"), ("ScalingActive", "True", "ValidMetricFound"))
    assert hpa_verdict(blocked)[:2] == ("False", "FailedGetScale")
    assert hpa_verdict(hpa(("ScalingActive", "True", "ValidMetricFound")))[:2] == ("False", "NoAbleToScale")
    good = hpa(("AbleToScale", "True", "ReadyForNewScale"), ("ScalingActive", "True", "ValidMetricFound"))
    assert hpa_verdict(good) == (
        "True",
        "ValidMetricFound",
        "HorizontalPodAutoscaler llama: ScalingActive says ValidMetricFound",
    )


def test_a_scaled_object_is_ready_when_keda_says_so():
    assert scaled_object_verdict(hpa())[:2] == ("False", "NotReported")
    assert scaled_object_verdict(hpa(("Ready", "Unknown", "Pending")))[:2] == ("False", "NotReported")
    assert scaled_object_verdict(hpa(("Ready", "False", "ScaledObjectCheckFailed")))[:2] == (
        "False",
        "ScaledObjectCheckFailed",
    )
    assert scaled_object_verdict(hpa(("Ready", "True", "ScaledObjectReady")))[:2] == ("True", "ScaledObjectReady")


def pool(*parents: dict) -> dict:
    spec = {"endpointPickerRef": {"kind": "Service", "name": "llama-epp", "port": {"number": 9002}}}
    return {"metadata": {"name": "llama"}, "spec": spec, "status": {"parents": list(parents)}}


def parent(gateway: str, accepted: str = "True", resolved: str | None = "True") -> dict:
    conds = [{"type": "Accepted", "status": accepted, "reason": "Accepted"}]
    if resolved is not None:
        conds.append(
            {"type": "ResolvedRefs", "status": resolved, "reason": "InvalidExtensionRef", "message": "no Service"}
        )
    return {"parentRef": {"kind": "Gateway", "name": gateway}, "conditions": conds}


def picker(*ready) -> list[dict]:
    return [
        {"endpoints": [{"addresses": ["10.0.0.1"], "conditions": {} if r is None else {"ready": r}} for r in ready]}
    ]


def test_a_pool_routes_once_a_gateway_accepts_it_and_its_picker_has_a_ready_endpoint():
    assert pool_verdict(pool(), picker(True))[:2] == ("False", "NotAccepted")
    assert pool_verdict(pool(parent("gw", accepted="False")), picker(True))[:2] == ("False", "NotAccepted")
    status, reason, message = pool_verdict(pool(parent("gw", resolved="False")), picker(True))
    assert (status, reason) == ("False", "InvalidExtensionRef") and message.endswith("no Service")
    status, reason, message = pool_verdict(pool(parent("gw")), picker(False))
    assert (status, reason) == ("False", "EndpointPickerUnavailable") and "llama-epp" in message
    status, reason, message = pool_verdict(pool(parent("b"), parent("a", resolved=None)), picker(False, True))
    assert (status, reason) == ("True", "Accepted") and "accepted by a, b" in message


def test_ready_endpoints_count_an_unset_ready_as_ready():
    assert ready_endpoints(picker(None, True, False)) == 2 and ready_endpoints([]) == 0
