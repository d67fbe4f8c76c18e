"""Where a ``PagedLLM``'s model files come from (``spec.modelSource``) and the claim that
caches downloads (``spec.modelCache``), parsed and checked like the rest of the spec."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.operator.spec_fields import SpecError, _dns_subdomain, _mapping, _quantity

MODEL_SOURCES = ("huggingface", "pvc")
MODEL_SOURCE_KEYS = ("type", "pvc", "uri", "revision", "credentialsSecret", "sizeGiB")
# spec.modelSource.uri scheme -> ModelSource.type
URI_SCHEMES = {"hf": "huggingface", "pvc": "pvc", "s3": "s3", "gs": "gs"}
RETAIN_POLICIES = ("Retain", "Delete")
ACCESS_MODES = ("ReadWriteOnce", "ReadWriteMany")
_REVISION_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./-]{0,254}$")
_URI_REST_RE = re.compile(r"^[A-Za-z0-9_./=+-]+$")


@dataclass(frozen=True)
class PvcModelSource:
    """An existing claim that holds the checkpoint."""

    claim_name: str
    path: str = ""


@dataclass(frozen=True)
class ModelSource:
    """Where the checkpoint comes from: the Hugging Face Hub, an existing claim, or an object store.

    ``type`` is ``huggingface`` or ``pvc`` as the spec names it, or ``s3`` / ``gs`` from a ``uri``.
    """

    type: str = "huggingface"
    pvc: PvcModelSource | None = None
    uri: str | None = None
    """spec.modelSource.uri as given (hf://, pvc://, s3://, gs://)."""
    location: str | None = None
    """What follows the scheme of an hf://, s3:// or gs:// uri (a Hub id, BUCKET/PREFIX)."""
    revision: str | None = None
    """A pinned Hub commit, tag or branch."""
    credentials_secret: str | None = None
    """A Secret whose keys become the download's environment (envFrom)."""
    size_gib: float | None = None
    """The checkpoint's size on disk, for the pods' memory and the download volume's size."""


@dataclass(frozen=True)
class ModelCache:
    """The claim the operator creates to keep downloads, filled once by a Job."""

    size: str
    storage_class_name: str | None = None
    access_mode: str = "ReadWriteOnce"
    retain_policy: str = "Retain"
    """Retain: the claim outlives the resource (no owner reference); Delete: it is deleted with it."""


def parse_model_source(path: str, value: Any) -> ModelSource:
    """``spec.modelSource``: ``type`` (+ ``pvc``) or ``uri``, with revision, credentials and size."""
    value = _mapping(path, value)
    unknown = sorted(set(value) - set(MODEL_SOURCE_KEYS))
    if unknown:
        raise SpecError(f"{path} has unknown field(s) {unknown}: allowed are {list(MODEL_SOURCE_KEYS)}")
    extra = _source_extras(path, value)
    if value.get("uri") is not None:
        return _uri_source(path, value, **extra)
    kind = value.get("type", "huggingface")
    if kind not in MODEL_SOURCES:
        raise SpecError(f"{path}.type={kind!r} is not allowed: choose one of {list(MODEL_SOURCES)}")
    pvc = value.get("pvc")
    if (kind == "pvc") != (pvc is not None):
        raise SpecError(
            f"{path}.pvc is required when {path}.type is pvc, and not allowed otherwise (type={kind!r}, pvc={pvc!r})"
        )
    if kind == "pvc" and extra["revision"] is not None:
        raise SpecError(
            f"{path}.revision={extra['revision']!r} is not allowed with {path}.type='pvc': only Hub models have "
            "revisions; put the version in the claim's path"
        )
    if pvc is None:
        return ModelSource(type=kind, **extra)
    pvc = _mapping(f"{path}.pvc", pvc)
    claim, sub = pvc.get("claimName"), pvc.get("path", "")
    if not isinstance(claim, str) or not claim:
        raise SpecError(f"{path}.pvc.claimName={claim!r} is not allowed: must be a non-empty string")
    return ModelSource(
        type=kind, pvc=PvcModelSource(claim_name=claim, path=_claim_path(f"{path}.pvc.path", sub)), **extra
    )


def _claim_path(path: str, sub: Any) -> str:
    if not isinstance(sub, str) or sub.startswith("/") or ".." in sub:
        raise SpecError(f"{path}={sub!r} is not allowed: a path relative to the claim, without a leading '/' or '..'")
    return sub.strip("/")


def _source_extras(path: str, value: Mapping[str, Any]) -> dict[str, Any]:
    revision, secret, size = value.get("revision"), value.get("credentialsSecret"), value.get("sizeGiB")
    if revision is not None and (not isinstance(revision, str) or not _REVISION_RE.match(revision) or ".." in revision):
        raise SpecError(
            f"{path}.revision={revision!r} is not allowed: a Hub commit, tag or branch "
            "(letters, digits and _ . / -, at most 255, no '..')"
        )
    if secret is not None:
        secret = _dns_subdomain(
            f"{path}.credentialsSecret.name", _mapping(f"{path}.credentialsSecret", secret).get("name")
        )
    if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size <= 65536):
        raise SpecError(f"{path}.sizeGiB={size!r} is out of range: a number of GiB > 0 and <= 65536")
    return {"revision": revision, "credentials_secret": secret, "size_gib": None if size is None else float(size)}


def _uri_source(path: str, value: Mapping[str, Any], **extra: Any) -> ModelSource:
    uri = value["uri"]
    clash = sorted(key for key in ("type", "pvc") if value.get(key) is not None)
    if clash:
        raise SpecError(f"{path}.uri={uri!r} is not allowed with {path}.{clash[0]}: the uri says where the model is")
    scheme, sep, rest = uri.partition("://") if isinstance(uri, str) else ("", "", "")
    rest = rest.strip("/")
    if scheme not in URI_SCHEMES or not sep or not rest or not _URI_REST_RE.match(rest) or ".." in rest:
        raise SpecError(
            f"{path}.uri={uri!r} is not allowed: use hf://ORG/NAME, pvc://CLAIM/PATH, s3://BUCKET/PREFIX or "
            "gs://BUCKET/PREFIX (letters, digits and _ . / = + -, no '..')"
        )
    kind = URI_SCHEMES[scheme]
    if extra["revision"] is not None and kind != "huggingface":
        raise SpecError(
            f"{path}.revision={extra['revision']!r} is not allowed with {path}.uri={uri!r}: only hf:// sources have "
            "revisions; put the version in the path"
        )
    if kind == "pvc":
        claim, _, sub = rest.partition("/")
        _dns_subdomain(f"{path}.uri (the claim's name)", claim)
        return ModelSource(type=kind, uri=uri, pvc=PvcModelSource(claim_name=claim, path=sub), **extra)
    return ModelSource(type=kind, uri=uri, location=rest, **extra)


def parse_model_cache(path: str, value: Any) -> ModelCache:
    """``spec.modelCache``: the claim downloads go into."""
    value = _mapping(path, value)
    size = _quantity(f"{path}.size", value.get("size"))
    mode = value.get("accessMode", "ReadWriteOnce")
    if mode not in ACCESS_MODES:
        raise SpecError(f"{path}.accessMode={mode!r} is not allowed: choose one of {list(ACCESS_MODES)}")
    storage_class = value.get("storageClassName")
    if storage_class is not None and not isinstance(storage_class, str):
        raise SpecError(f"{path}.storageClassName={storage_class!r} has the wrong type: must be a string")
    retain = value.get("retainPolicy", "Retain")
    if retain not in RETAIN_POLICIES:
        raise SpecError(f"{path}.retainPolicy={retain!r} is not allowed: choose one of {list(RETAIN_POLICIES)}")
    return ModelCache(size=str(size), storage_class_name=storage_class, access_mode=mode, retain_policy=retain)
