"""Drift: where a live child no longer matches its rendering, and whose child it is (pure functions).

Only what the rendering sets is compared, the way server-side apply owns fields: the
API server's defaults (``clusterIP``, ``terminationMessagePath``), a Deployment's
``status`` and list items other managers added are not drift, since applying again
would not change them anyway. A field the operator renders and someone changed by
hand (``kubectl scale --replicas 5``, an edited image) is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes.utils import parse_quantity

COMPARED = ("metadata", "spec")
_EMPTY: tuple = (None, {}, [], "")


def drifted(desired: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    """Paths (``spec.replicas``) where ``live`` differs from what ``desired`` sets; [] if none."""
    found: list[str] = []
    for key in COMPARED:
        if key in desired:
            _compare(desired[key], live.get(key), key, found)
    return found


def _compare(want: Any, have: Any, path: str, found: list[str]) -> None:
    if isinstance(want, Mapping):
        if want in _EMPTY and have in _EMPTY:
            return
        if not isinstance(have, Mapping):
            found.append(path)
            return
        for key, value in want.items():
            _compare(value, have.get(key), f"{path}.{key}", found)
    elif isinstance(want, list):
        _compare_list(want, have, path, found)
    elif not _same_scalar(want, have):
        found.append(path)


def _compare_list(want: list, have: Any, path: str, found: list[str]) -> None:
    if not want and have in _EMPTY:
        return
    if not isinstance(have, list):
        found.append(path)
        return
    if not all(isinstance(item, Mapping) for item in want):
        if want != have:  # NOTE: lists of scalars (command, args) are atomic: replaced whole on apply
            found.append(path)
        return
    for index, item in enumerate(want):
        if not any(not drifted_item(item, other) for other in _candidates(item, have)):
            found.append(f"{path}[{item.get('name', index)}]")


def _candidates(item: Mapping[str, Any], have: list) -> list:
    """Live items that could be ``item``: the same ``name`` where items are named."""
    if "name" in item:
        return [other for other in have if isinstance(other, Mapping) and other.get("name") == item["name"]]
    return [other for other in have if isinstance(other, Mapping)]


def drifted_item(want: Mapping[str, Any], have: Mapping[str, Any]) -> list[str]:
    found: list[str] = []
    _compare(want, have, "", found)
    return found


def _same_scalar(want: Any, have: Any) -> bool:
    if want == have and type(want) is type(have):
        return True
    # The API server canonicalises quantities: 1 -> "1", "0.5" -> "500m".
    if isinstance(want, (int, float, str)) and isinstance(have, (int, float, str)) and not isinstance(want, bool):
        try:
            return parse_quantity(want) == parse_quantity(have)
        except ValueError:
            return False
    return False


def foreign_controller(live: Mapping[str, Any] | None, owner_uid: str | None) -> str | None:
    """``Kind/name`` of the controller of ``live`` if that is not the owner ``owner_uid``."""
    for ref in (live or {}).get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("uid") != owner_uid:
            return f"{ref.get('kind')}/{ref.get('name')}"
    return None
