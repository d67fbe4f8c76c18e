"""Offline stand-ins for what the API server does with the CRD's structural schema.

- :func:`to_jsonschema`: the openAPIV3Schema as a JSON Schema (draft 2020-12; OpenAPI
  3.0's boolean ``exclusiveMinimum`` becomes a bound) that rejects unknown fields (the
  API server would prune them; a test wants to see typos), so ``jsonschema`` can
  validate resources against it.
- :func:`apply_defaults`: the API server's defaulting (a ``default`` fills a missing
  field wherever its parent object exists).
- :func:`cel_rules`: every ``x-kubernetes-validations`` rule with the path it applies at.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

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
