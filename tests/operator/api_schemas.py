"""The schemas the emulated API server validates every write against, and the list keys it merges by.

- Built-in kinds: the Kubernetes OpenAPI schemas that ``kubernetes-validate`` ships (its
  ``-strict`` variant: an unknown field is an error, as with ``fieldValidation=Strict``), one
  validator per kind built once.
- Kinds of CRDs: the ``openAPIV3Schema`` of a CRD created in the emulator (the PagedLLM
  CRD, or any other a test creates), or of one the tests vendor as published upstream
  (``schemas/``: LeaderWorkerSet, KEDA's ScaledObject and its HTTP add-on's HTTPScaledObject,
  the Prometheus Operator's PodMonitor, the Gateway API Inference Extension's InferencePool),
  through :mod:`crd_jsonschema`.

:meth:`ApiSchemas.list_keys` gives the keys of every ``x-kubernetes-list-type: map`` list
of a kind (``containers`` by ``name``, ``ports`` by ``containerPort`` and ``protocol``, ...),
which server-side apply merges item by item.

:meth:`ApiSchemas.admit` turns a write into what is stored: unknown fields dropped or
refused (``fieldValidation``), defaults filled in, schema and CEL rules checked.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gzip
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import builtin_defaults
import crd_jsonschema
import jsonschema
import yaml
from kubernetes_validate import utils as kv_utils
from referencing import Registry, Resource

KUBERNETES_VERSION = "1.30"
SCHEMAS = Path(__file__).parent / "schemas"
VENDORED_CRDS = (
    "leaderworkerset.x-k8s.io_leaderworkersets.yaml.gz",
    "http.keda.sh_httpscaledobjects.yaml.gz",
    "keda.sh_scaledobjects.yaml.gz",
    "monitoring.coreos.com_podmonitors.yaml.gz",
    "inference.networking.k8s.io_inferencepools.yaml.gz",
)

Path_ = tuple[str, ...]  # field names, "[]" for a list's items


class SchemaError(ValueError):
    """A write the schema refuses; ``str()`` is the API server's field error (``spec.x: ...``)."""


def _field(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


@functools.cache
def _builtin(api_version: str, kind: str) -> tuple[jsonschema.Draft202012Validator, dict, Registry] | None:
    local = f"v{KUBERNETES_VERSION}.0-local-strict"
    group_version = api_version.split("/")
    group = group_version[0].split(".")[0] if len(group_version) == 2 else "core"
    stem = f"{kind.lower()}-{group}-{group_version[-1]}" if group != "core" else f"{kind.lower()}-{group_version[-1]}"
    try:
        schema = kv_utils.schema_contents(f"kubernetes-json-schema/{local}/{stem}.json", KUBERNETES_VERSION)
    except FileNotFoundError:
        return None
    defs = _definitions()
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry), defs, registry


@functools.cache
def _definitions() -> dict:
    local = f"v{KUBERNETES_VERSION}.0-local-strict"
    return kv_utils.schema_contents(f"kubernetes-json-schema/{local}/_definitions.json", KUBERNETES_VERSION)


def vendored_crd_schema(api_version: str, kind: str) -> dict | None:
    """The ``openAPIV3Schema`` of a kind whose upstream CRD the tests vendor (``schemas/``), else ``None``."""
    return _vendored_crds().get((api_version, kind))


@functools.cache
def _vendored_crds() -> dict[tuple[str, str], dict]:
    out = {}
    for name in VENDORED_CRDS:
        out.update(crd_versions(yaml.safe_load(gzip.decompress((SCHEMAS / name).read_bytes()))))
    return out


def crd_versions(crd: dict) -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> openAPIV3Schema of every version a CRD serves."""
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    return {
        (f"{group}/{v['name']}", kind): v["schema"]["openAPIV3Schema"]
        for v in crd["spec"]["versions"]
        if v.get("served", True) and "schema" in v
    }


@dataclasses.dataclass(frozen=True)
class Admitted:
    """An object as the API server stores it, and the warnings its answer carries."""

    obj: dict
    warnings: tuple[str, ...] = ()
    dropped: tuple[tuple, ...] = ()
    """Paths of the unknown fields left out (``("spec", "foo")``), for a patch to leave out too."""


def drop_unknown(validator: jsonschema.Draft202012Validator, obj: dict) -> tuple[dict, list[tuple]]:
    """``obj`` without the fields its schema does not declare, and their paths (``("spec", "foo")``)."""
    obj = copy.deepcopy(obj)
    dropped: list[tuple] = []
    for _ in range(100):  # NOTE: a field inside a dropped one is never reported; each pass finds new ones
        found = sorted(set(_unknown(validator.iter_errors(obj))))
        if not found:
            break
        for path, name in found:
            parent = _at(obj, path)
            if isinstance(parent, dict) and name in parent:
                del parent[name]
                dropped.append((*path, name))
    return obj, dropped


def _unknown(errors) -> Iterator[tuple[tuple, str]]:
    for error in errors:
        if error.validator == "additionalProperties" and error.validator_value is False:
            declared = error.schema.get("properties") or {}
            patterns = error.schema.get("patternProperties") or {}
            for name in error.instance if isinstance(error.instance, dict) else ():
                if name not in declared and not any(re.search(p, name) for p in patterns):
                    yield tuple(error.absolute_path), name
        yield from _unknown(error.context or [])


def _at(obj: Any, path: tuple) -> Any:
    for part in path:
        obj = obj[part]
    return obj


class ApiSchemas:
    """Validation and list keys per kind; CRDs created in the emulator are added with :meth:`learn_crd`."""

    def __init__(self) -> None:
        self.crds: dict[tuple[str, str], dict] = {}
        self._crd_keys: dict[tuple[str, str], dict[Path_, tuple[str, ...]]] = {}

    def learn_crd(self, crd: dict) -> None:
        self.crds.update(crd_versions(crd))
        self._crd_keys.clear()

    def crd_schema(self, api_version: str, kind: str) -> dict | None:
        return self.crds.get((api_version, kind)) or _vendored_crds().get((api_version, kind))

    def admit(self, obj: dict, field_validation: str = "Strict", old: dict | None = None) -> Admitted:
        """``obj`` as the API server stores it, with the warnings it answers, or :class:`SchemaError`.

        As the API server does: unknown fields dropped (``fieldValidation=Ignore``; ``Warn``,
        the API server's default, with a warning each; ``Strict`` refuses them), the CRD
        schema's ``default`` values and the built-in kinds' defaults (:mod:`builtin_defaults`)
        filled in, then the schema checked and, for the kinds of CRDs, their
        ``x-kubernetes-validations`` CEL rules (transition rules against ``old``).
        """
        key = (obj.get("apiVersion", ""), obj.get("kind", ""))
        warnings: tuple[str, ...] = ()
        dropped: list[tuple] = []
        validator = self.validator(*key)
        if field_validation in ("Ignore", "Warn") and validator is not None:
            obj, dropped = drop_unknown(validator, obj)
            if field_validation == "Warn":
                warnings = tuple(f'unknown field "{_field(path)}"' for path in dropped)
        crd = self.crd_schema(*key)
        if crd is not None:
            obj = crd_jsonschema.apply_defaults(crd, obj)
        obj = builtin_defaults.default_object(obj)
        self.validate(obj)
        failed = crd_jsonschema.cel_failures(crd, obj, old) if crd is not None else []
        if failed:
            field, message = failed[0]
            raise SchemaError(f'{field}: Invalid value: "object": {message}')
        return Admitted(obj, warnings, tuple(dropped))

    def validator(self, api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
        """The kind's validator; ``None`` for a kind without a schema (anything passes)."""
        crd = self.crd_schema(api_version, kind)
        if crd is not None:
            return crd_jsonschema.resource_validator(crd)
        found = _builtin(api_version, kind)
        return None if found is None else found[0]

    def validate(self, obj: dict) -> None:
        """Raise :class:`SchemaError` where ``obj`` breaks its kind's schema; a kind without one passes."""
        validator = self.validator(obj.get("apiVersion", ""), obj.get("kind", ""))
        if validator is None:
            return
        error = jsonschema.exceptions.best_match(validator.iter_errors(obj))
        if error is not None:
            raise SchemaError(f"{_field(error.absolute_path)}: {error.message[:300]}")

    def list_keys(self, api_version: str, kind: str) -> dict[Path_, tuple[str, ...]]:
        """Path of each keyed list of the kind -> its keys (``("spec", "template", ..., "containers")``)."""
        crd = self.crd_schema(api_version, kind)
        if crd is not None:
            if (api_version, kind) not in self._crd_keys:
                self._crd_keys[(api_version, kind)] = _keys_of(crd, {}, ())
            return self._crd_keys[(api_version, kind)]
        found = _builtin(api_version, kind)
        return {} if found is None else _builtin_keys(api_version, kind)


@functools.cache
def _builtin_keys(api_version: str, kind: str) -> dict[Path_, tuple[str, ...]]:
    found = _builtin(api_version, kind)
    assert found is not None
    validator, defs, _ = found
    return _keys_of(validator.schema, defs.get("$defs", {}), ())


def _keys_of(
    schema: Any, defs: dict, path: Path_, depth: int = 0, seen: frozenset = frozenset()
) -> dict[Path_, tuple[str, ...]]:
    """NOTE: a definition met again below itself (a CRD's JSONSchemaProps) is not walked again."""
    if not isinstance(schema, dict) or depth > 40:
        return {}
    ref = schema.get("$ref") or next(
        (s["$ref"] for s in schema.get("allOf", []) + schema.get("oneOf", []) if isinstance(s, dict) and "$ref" in s),
        None,
    )
    if ref is not None:
        name = ref.rsplit("/", 1)[-1]
        if name.endswith((".ObjectMeta", ".ManagedFieldsEntry")) or name in seen:
            return {}
        return _keys_of(defs.get(name, {}), defs, path, depth + 1, seen | {name})
    out: dict[Path_, tuple[str, ...]] = {}
    keys = schema.get("x-kubernetes-list-map-keys") or (
        [schema["x-kubernetes-patch-merge-key"]]
        if schema.get("x-kubernetes-patch-strategy", "").startswith("merge")
        and "x-kubernetes-patch-merge-key" in schema
        else []
    )
    if keys and schema.get("x-kubernetes-list-type", "map") == "map":
        out[path] = tuple(keys)
    for name, sub in (schema.get("properties") or {}).items():
        if path == () and name in ("metadata", "status"):
            continue
        out.update(_keys_of(sub, defs, (*path, name), depth + 1, seen))
    if isinstance(schema.get("items"), dict):
        out.update(_keys_of(schema["items"], defs, (*path, "[]"), depth + 1, seen))
    return out
