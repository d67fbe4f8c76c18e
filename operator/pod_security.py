"""The security contexts of every pod and container the operator renders: non-root, no privileges,
a read-only root filesystem (the writable directories are emptyDirs)."""

from __future__ import annotations

RUN_AS = 1000  # the image's non-root user (Dockerfile: USER 1000)


def pod_security() -> dict:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "fsGroupChangePolicy": "OnRootMismatch",  # NOTE: no slow recursive chown of a big model cache
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> dict:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
