"""Offline validation of rendered objects: Kubernetes' own schemas, or the project's for CRD kinds.

Built-in kinds (Deployment, HorizontalPodAutoscaler, PodDisruptionBudget, ...) go through
``kubernetes-validate``. The kinds of other projects' CRDs (KEDA's ScaledObject, the
Gateway API Inference Extension's InferencePool, the Prometheus Operator's PodMonitor)
have no bundled schema there, so ``schemas/`` holds one JSON Schema each, written by
this project from those projects' published API references (group, version, required
fields and their types), strict about unknown spec fields so a typo fails.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jsonschema
import kubernetes_validate

SCHEMAS = Path(__file__).parent / "schemas"
THIRD_PARTY = {
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.keda.sh-v1alpha1.json",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool.inference.networking.k8s.io-v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.monitoring.coreos.com-v1.json",
}


@functools.cache
def third_party_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / THIRD_PARTY[(api_version, kind)]).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def validate_manifest(manifest: dict, version: str = "1.30") -> None:
    """Raise if ``manifest`` does not fit its kind's schema."""
    key = (manifest["apiVersion"], manifest["kind"])
    if key in THIRD_PARTY:
        third_party_validator(*key).validate(manifest)
    else:
        kubernetes_validate.validate(manifest, version, strict=True)
