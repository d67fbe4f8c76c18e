"""What the operator tests against the emulator share: resources, lookups, and a per-test namespace view."""

from __future__ import annotations

import contextlib

import yaml
from helm_tools import CRD_PATH
from k8s_emulator import Client, EmulatedCluster, wait_for
from rbac_policy import RbacPolicy

KIND = "PagedLLM"


@contextlib.contextmanager
def emulated_cluster(policy: RbacPolicy):
    """A started emulated API server with the PagedLLM CRD that authorizes the operator by ``policy``.

    Fails at the end if the operator was refused anything (the chart must grant what it does) or
    was warned of a field the API server dropped (a rendering the schema does not know).
    """
    emulated = EmulatedCluster(policy).start()
    status, body = Client(emulated.url).request(
        "POST",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
        yaml.safe_load(CRD_PATH.read_text()),
        "application/json",
    )
    assert status in (200, 201), body
    try:
        yield emulated
    finally:
        denials, warnings = emulated.denials(), emulated.warnings()
        emulated.stop()
    assert not denials, "the chart's RBAC refused the operator:\n" + "\n".join(denials)
    assert not warnings, "the API server dropped fields the operator wrote:\n" + "\n".join(warnings)


def pagedllm(namespace: str, name: str = "llama", **spec) -> dict:
    return {
        "apiVersion": "pagedllm.dev/v1alpha1",
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": "meta-llama/Llama-2-7b-hf", **spec},
    }


def server_container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def flag_value(args: list[str], flag: str):
    return args[args.index(flag) + 1] if flag in args else None


def condition(obj: dict, kind: str) -> dict:
    for cond in (obj.get("status") or {}).get("conditions", []):
        if cond["type"] == kind:
            return cond
    return {}


class Scenario:
    """A namespace's view: the API client, the operator, and polls with its log on timeout."""

    def __init__(self, api, operator, namespace: str):
        self.api, self.operator, self.ns = api, operator, namespace

    def wait(self, probe, what: str, timeout: float = 15):
        return wait_for(probe, timeout=timeout, what=what, on_timeout=self.operator.log)

    def get(self, kind: str, name: str = "llama"):
        return self.api.get(kind, self.ns, name)

    def wait_status(self, check, what: str, name: str = "llama", timeout: float = 15):
        def probe():
            obj = self.get(KIND, name)
            return obj if obj and check(obj.get("status") or {}, obj) else None

        return self.wait(probe, what, timeout)

    def wait_deployment(self, check=lambda d: True, what: str = "the Deployment", name: str = "llama"):
        def probe():
            dep = self.get("Deployment", name)
            return dep if dep and check(dep) else None

        return self.wait(probe, what)

    def events(self) -> list[dict]:
        return self.api.list("Event", self.ns)
