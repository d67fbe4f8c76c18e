"""Parsing primitives of the ``PagedLLM`` spec: each takes a field's ``spec.`` path and raw value and
returns the checked value, or raises :class:`SpecError` naming path, value and what is allowed."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
_DNS_LABEL_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUANTITY_RE = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


class SpecError(ValueError):
    """A spec value the operator cannot serve; the message names field, value and what is allowed."""


def _mapping(path: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SpecError(f"{path}={value!r} has the wrong type: must be an object")
    return value


def _list(path: str, value: Any) -> list:
    if not isinstance(value, list):
        raise SpecError(f"{path}={value!r} has the wrong type: must be a list")
    return value


def _quantity(path: str, value: Any) -> Any:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, str))
        or (isinstance(value, str) and not _QUANTITY_RE.match(value))
    ):
        raise SpecError(f"{path}={value!r} is not a quantity: use e.g. 4, 500m, 32Gi")
    return value


def _resources(path: str, value: Any) -> Mapping[str, Mapping[str, Any]]:
    value = _mapping(path, value)
    out = {}
    for part in ("requests", "limits"):
        amounts = _mapping(f"{path}.{part}", value.get(part, {}))
        if GPU_RESOURCE in amounts:
            raise SpecError(
                f"{path}.{part}[{GPU_RESOURCE!r}]={amounts[GPU_RESOURCE]!r} is not allowed: "
                "GPUs come from tensorParallelSize"
            )
        if amounts:
            out[part] = {name: _quantity(f"{path}.{part}[{name!r}]", q) for name, q in amounts.items()}
    return out


def _string_map(path: str, value: Any) -> Mapping[str, str]:
    value = _mapping(path, value)
    for key, item in value.items():
        if not isinstance(item, str):
            raise SpecError(f"{path}[{key!r}]={item!r} has the wrong type: must be a string")
    return dict(value)


def _object_list(path: str, value: Any) -> tuple:
    items = _list(path, value)
    for index, item in enumerate(items):
        _mapping(f"{path}[{index}]", item)
    return tuple(dict(item) for item in items)


def _env(path: str, value: Any) -> tuple:
    items = _object_list(path, value)
    for index, item in enumerate(items):
        if not isinstance(item.get("name"), str) or not item["name"]:
            raise SpecError(f"{path}[{index}].name={item.get('name')!r} is not allowed: must be a non-empty string")
    return items


def _string_list(path: str, value: Any) -> tuple[str, ...]:
    items = _list(path, value)
    for index, item in enumerate(items):
        if not isinstance(item, str):
            raise SpecError(f"{path}[{index}]={item!r} has the wrong type: must be a string")
    return tuple(items)


def _plain_object(path: str, value: Any) -> Mapping[str, Any]:
    return dict(_mapping(path, value))


def dns_label(path: str, value: Any, names: str) -> str:
    """``value`` if it is a DNS-1035 label (a Service's name), else a :class:`SpecError`
    saying it ``names`` (what the name is used for)."""
    if not isinstance(value, str) or len(value) > 63 or not _DNS_LABEL_RE.match(value):
        raise SpecError(
            f"{path}={value!r} is not allowed: it names {names}, so it must be a DNS-1035 label "
            "(lowercase letters, digits and '-', starting with a letter, at most 63)"
        )
    return value


def _dns_subdomain(path: str, value: Any) -> str:
    if not isinstance(value, str) or len(value) > 253 or not _DNS_SUBDOMAIN_RE.match(value):
        raise SpecError(
            f"{path}={value!r} is not allowed: a Kubernetes object name "
            "(lowercase letters, digits, '-' and '.', at most 253)"
        )
    return value


def _name_refs(path: str, value: Any) -> tuple[str, ...]:
    """``[{name: regcred}, ...]`` (imagePullSecrets) -> the names."""
    items = _object_list(path, value)
    return tuple(_dns_subdomain(f"{path}[{index}].name", item.get("name")) for index, item in enumerate(items))


def _spread_constraints(path: str, value: Any) -> tuple:
    items = _object_list(path, value)
    for index, item in enumerate(items):
        missing = [key for key in ("maxSkew", "topologyKey", "whenUnsatisfiable") if key not in item]
        if missing:
            raise SpecError(f"{path}[{index}]={item!r} is not allowed: {', '.join(missing)} required")
    return items
