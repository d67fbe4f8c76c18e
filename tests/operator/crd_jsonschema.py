"""Offline stand-ins for what the API server does with the CRD's structural schema.

- :func:`to_jsonschema`: the openAPIV3Schema as a JSON Schema (draft 2020-12; OpenAPI
  3.0's boolean ``exclusiveMinimum`` becomes a bound) that rejects unknown fields (the
  API server would prune them; a test wants to see typos), so ``jsonschema`` can
  validate resources against it.
- :func:`apply_defaults`: the API server's defaulting (a ``default`` fills a missing
  field wherever its parent object exists).
- :func:`cel_rules`: every ``x-kubernetes-validations`` rule with the path it applies at,
  :func:`cel_failures`: the fields and messages of those a resource breaks, at every
  field, list item and map value (``celpy``; transition rules against the stored object),
  and :func:`failed_cel_rules`: their messages.
- :func:`resource_validator`: a validator for whole resources, built once per schema.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

_DROP = {
    "x-kubernetes-validations",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-embedded-resource",
    "nullable",
    "format",
}


def to_jsonschema(node: Any) -> Any:
    if isinstance(node, list):
        return [to_jsonschema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {name: to_jsonschema(sub) for name, sub in value.items()}
        else:
            out[key] = to_jsonschema(value)
    if node.get("exclusiveMinimum") is True:  # OpenAPI 3.0's flag is JSON Schema's bound
        out["exclusiveMinimum"] = out.pop("minimum")
    if (
        node.get("type") == "object"
        and "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if node.get("type") == "object" and node.get("properties", {}).keys() >= {"apiVersion", "kind", "metadata"}:
        out["properties"]["metadata"] = {"type": "object"}  # ObjectMeta is the server's, not ours
    return out


def apply_defaults(schema: dict, value: Any) -> Any:
    """``value`` with the schema's defaults filled in, as the API server would."""
    value = copy.deepcopy(value)
    _default_into(schema, value)
    return value


def _default_into(schema: dict, value: Any) -> None:
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _default_into(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            _default_into(schema["items"], item)


def walk(schema: dict, path: str = "") -> Iterator[tuple[str, dict]]:
    """Every subschema with its dotted path (``spec.modelSource.pvc``; ``[]`` for items)."""
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}" if path else name)
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def cel_rules(schema: dict) -> Iterator[tuple[str, str, str]]:
    """(path, rule, message) of every CEL validation rule."""
    for path, sub in walk(schema):
        for rule in sub.get("x-kubernetes-validations", []):
            yield path, rule["rule"], rule.get("message", "")


def spec_schema(crd_schema: dict) -> dict:
    """The schema of a resource's ``spec``."""
    return crd_schema["properties"]["spec"]


_VALIDATORS: dict = {}


def resource_validator(crd_schema: dict) -> jsonschema.Draft202012Validator:
    """A validator for whole resources (built once: checking the schema itself is slow)."""
    key = id(crd_schema)
    if key not in _VALIDATORS:
        schema = to_jsonschema(crd_schema)
        jsonschema.Draft202012Validator.check_schema(schema)
        _VALIDATORS[key] = jsonschema.Draft202012Validator(schema)
    return _VALIDATORS[key]


def cel_failures(schema: dict, value: Any, old: Any = None, path: str = "") -> list[tuple[str, str]]:
    """(field path, message) of every ``x-kubernetes-validations`` rule ``value`` breaks, as the API server
    checks them: at each field present (list items and map values included), transition rules (those that
    name ``oldSelf``) only where ``old``, the stored object, has the field too (list items have no old
    value here)."""
    failed = [(path or "<root>", message) for message in _broken(schema, value, old)]
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                before = old.get(name) if isinstance(old, dict) else None
                failed += cel_failures(sub, value[name], before, f"{path}.{name}" if path else name)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, sub_value in value.items():
                before = old.get(name) if isinstance(old, dict) else None
                failed += cel_failures(extra, sub_value, before, f"{path}[{name}]")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            failed += cel_failures(schema["items"], item, None, f"{path}[{index}]")
    return failed


def _broken(schema: dict, value: Any, old: Any) -> list[str]:
    rules = schema.get("x-kubernetes-validations") or []
    if not rules:
        return []
    celpy = _maybe_celpy()
    if celpy is None:
        return []
    out = []
    for rule in rules:
        activation = {"self": celpy.json_to_cel(value)}
        if "oldSelf" in rule["rule"]:
            if old is None:
                continue
            activation["oldSelf"] = celpy.json_to_cel(old)
        try:
            result = _cel_program(rule["rule"]).evaluate(activation)
        except celpy.CELEvalError:  # NOTE: the API server refuses a write whose rule cannot be evaluated
            result = None
        if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            out.append(rule.get("message") or f"failed rule: {rule['rule']}")
    return out


def failed_cel_rules(crd_schema: dict, obj: dict, *, required: bool = True) -> list[str]:
    """Messages of the CEL rules ``obj`` (a defaulted resource) breaks."""
    if required:
        pytest.importorskip("celpy", reason="cel-python evaluates the CRD's CEL rules offline")
    return [message for _, message in cel_failures(crd_schema, obj)]


@functools.cache
def _cel_program(rule: str):
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def _maybe_celpy():
    try:
        import celpy
    except ImportError:
        return None
    return celpy
