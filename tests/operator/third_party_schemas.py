"""Offline validation of rendered objects: Kubernetes' own schemas, or the upstream CRDs for other projects' kinds.

Built-in kinds (Deployment, HorizontalPodAutoscaler, PodDisruptionBudget, ...) go through
``kubernetes-validate``. The kinds of other projects' CRDs (KEDA's ScaledObject and
HTTPScaledObject, the Gateway API Inference Extension's InferencePool, the Prometheus
Operator's PodMonitor, LeaderWorkerSet) go through those projects' published CRDs, vendored
in ``schemas/`` (see :data:`api_schemas.VENDORED_CRDS`): defaults filled in, then the
``openAPIV3Schema`` (strict: an unknown field fails, where the API server would prune it)
and its ``x-kubernetes-validations`` CEL rules checked, as a cluster with the CRD installed would.
"""

from __future__ import annotations

import crd_jsonschema
import jsonschema
import kubernetes_validate
from api_schemas import vendored_crd_schema


def validate_manifest(manifest: dict, version: str = "1.30") -> None:
    """Raise (a ``jsonschema.ValidationError`` for a CRD kind) if ``manifest`` does not fit its kind's schema."""
    schema = vendored_crd_schema(manifest["apiVersion"], manifest["kind"])
    if schema is None:
        kubernetes_validate.validate(manifest, version, strict=True)
        return
    defaulted = crd_jsonschema.apply_defaults(schema, manifest)
    crd_jsonschema.resource_validator(schema).validate(defaulted)
    failed = crd_jsonschema.cel_failures(schema, defaulted)
    if failed:
        field, message = failed[0]
        raise jsonschema.ValidationError(f"{field}: {message}")
