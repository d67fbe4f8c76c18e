"""An operator restart resumes: what drifted while it was down is put right (kopf resume)."""

from __future__ import annotations

import pytest
from k8s_emulator import wait_for
from operator_process import running_operator

pytestmark = pytest.mark.k8s

NS = "restart"


def pagedllm(name: str, **spec) -> dict:
    return {
        "apiVersion": "pagedllm.dev/v1alpha1",
        "kind": "PagedLLM",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": "org/model", **spec},
    }


def block_size(api, name: str):
    dep = api.get("Deployment", NS, name)
    if dep is None:
        return None
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index("--block-size") + 1]


def handled(api, name: str) -> bool:
    obj = api.get("PagedLLM", NS, name)
    return bool(
        obj
        and "pagedllm.dev/last-handled-configuration" in obj["metadata"].get("annotations", {})
        and (obj.get("status") or {}).get("phase")
    )


def test_restart_recreates_deleted_children_and_applies_missed_changes(cluster, api, tmp_path):
    with running_operator(cluster, tmp_path / "first") as first:
        for name in ("steady", "edited"):
            api.create(pagedllm(name))
        for name in ("steady", "edited"):
            wait_for(
                lambda name=name: handled(api, name) and block_size(api, name) == "16",
                what=f"{name} handled",
                on_timeout=first.log,
            )

    # While no operator runs: a Deployment is deleted by hand, another resource is edited.
    api.delete("Deployment", NS, "steady")
    api.patch("PagedLLM", NS, "edited", {"spec": {"blockSize": 64}})

    with running_operator(cluster, tmp_path / "second") as second:
        wait_for(lambda: block_size(api, "steady") == "16", what="steady's Deployment back", on_timeout=second.log)
        wait_for(lambda: block_size(api, "edited") == "64", what="edited's missed change", on_timeout=second.log)
        wait_for(
            lambda: (api.get("PagedLLM", NS, "edited").get("status") or {}).get("observedGeneration") == 2,
            what="observedGeneration 2",
            on_timeout=second.log,
        )
