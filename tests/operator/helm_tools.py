"""Repository paths, the helm runner and RBAC rule sets shared by the chart and operator tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "pagedllm.yaml"
CHART_DIR = ROOT / "charts" / "pagedllm"
INSTALL_SCRIPT = ROOT / "scripts" / "install-k8s-tools.sh"
TOOLS_BIN = ROOT / ".tools" / "bin"


class HelmError(AssertionError):
    """helm exited non-zero; the message holds its output."""


def run_helm(helm: str, *args: str) -> str:
    result = subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise HelmError(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


def rules_of(role: dict) -> set[tuple[str, str, str]]:
    """(group, resource, verb) of every grant in a (Cluster)Role."""
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
