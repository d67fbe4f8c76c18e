"""The admin's allow-lists: images by pattern, service accounts, priority and runtime classes by name."""

from __future__ import annotations

from pagedllm.operator.policy import NOT_ALLOWED, AdminPolicy
from pagedllm.operator.spec import PagedLLMSpec

DEFAULT, PICKER = "ghcr.io/pagedllm/pagedllm:0.1.0", "registry.k8s.io/gateway-api-inference-extension/epp:v1.0.1"


def spec(**fields) -> PagedLLMSpec:
    return PagedLLMSpec.from_dict({"model": "org/model", **fields})


def check(policy: AdminPolicy, **fields):
    return policy.check(spec(**fields), DEFAULT, PICKER)


def test_no_lists_allow_anything_but_a_foreign_service_account():
    assert check(AdminPolicy(), image="anything:1", serviceAccountName="default", runtimeClassName="x") is None
    assert check(AdminPolicy()) is None  # unset: the namespace's default account


def test_foreign_service_accounts_are_refused_unless_allowed():
    problem = check(AdminPolicy(), serviceAccountName="cloud-admin")
    assert problem is not None and problem.reason == NOT_ALLOWED
    assert problem.message == (
        "spec.serviceAccountName='cloud-admin' is not allowed by the cluster's policy: allowed are ['default']"
    )
    assert check(AdminPolicy(service_accounts=("cloud-admin",)), serviceAccountName="cloud-admin") is None
    assert check(AdminPolicy(service_accounts=("cloud-admin",)), serviceAccountName="default") is None


def test_images_match_by_pattern_the_default_one_included():
    policy = AdminPolicy(images=("ghcr.io/pagedllm/*", "registry.k8s.io/gateway-api-inference-extension/epp:*"))
    assert check(policy) is None and check(policy, image="ghcr.io/pagedllm/pagedllm:dev") is None
    problem = check(policy, image="docker.io/evil/miner:1")
    assert problem is not None and problem.reason == NOT_ALLOWED
    assert problem.message == (
        "spec.image='docker.io/evil/miner:1' is not allowed by the cluster's policy: "
        "allowed are ['ghcr.io/pagedllm/*', 'registry.k8s.io/gateway-api-inference-extension/epp:*']"
    )
    strict = AdminPolicy(images=("mirror.example/*",))
    assert "the operator's default image='ghcr.io/pagedllm/pagedllm:0.1.0'" in check(strict).message


def test_a_deployed_picker_image_is_checked_too():
    policy = AdminPolicy(images=("ghcr.io/pagedllm/*",))
    routing = {"inferencePool": True, "endpointPicker": {"deploy": True}}
    assert "the default endpoint picker image=" in check(policy, routing=routing).message
    own = {"inferencePool": True, "endpointPicker": {"deploy": True, "image": "ghcr.io/pagedllm/epp:1"}}
    assert check(policy, routing=own) is None
    assert check(policy, routing={"inferencePool": True}) is None  # not deployed: not ours to run


def test_names_match_exactly_and_unset_is_allowed():
    policy = AdminPolicy(service_accounts=("llm",), priority_classes=("inference",), runtime_classes=("nvidia",))
    assert check(policy) is None
    assert check(policy, serviceAccountName="llm", priorityClassName="inference", runtimeClassName="nvidia") is None
    for field, value, allowed in (
        ("serviceAccountName", "llm-admin", "['default', 'llm']"),
        ("priorityClassName", "system-cluster-critical", "['inference']"),
        ("runtimeClassName", "kata", "['nvidia']"),
    ):
        problem = check(policy, **{field: value})
        assert problem is not None and problem.message == (
            f"spec.{field}={value!r} is not allowed by the cluster's policy: allowed are {allowed}"
        )
