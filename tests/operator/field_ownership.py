"""Server-side apply's field ownership, for the emulated API server (``spec`` fields only).

What the operator's replica hand-over depends on, as the API server does it:

- each write records which ``spec`` leaf fields its field manager set, in
  ``metadata.managedFields`` (``fieldsV1``), with operation ``Apply`` (server-side apply)
  or ``Update`` (any other write, a ``/scale`` write among them);
- a field a manager sets is taken from every other manager (an apply is always forced here,
  as the operator's are; an update always takes the field);
- a field that an ``Apply`` manager set before and no longer applies is removed from the
  object, unless another manager still owns it.

Lists are single fields (atomic), where the API server merges some by their keys; that only
matters to an apply that drops one item of a list another manager added to.
"""

from __future__ import annotations

import copy
from typing import Any

Path = tuple[str, ...]


def leaf_paths(value: Any, prefix: Path = ()) -> set[Path]:
    """The leaf fields of a (nested) mapping; lists and scalars are leaves."""
    if isinstance(value, dict) and value:
        return {p for key, sub in value.items() for p in leaf_paths(sub, (*prefix, key))}
    return {prefix} if prefix else set()


def to_fields_v1(paths: set[Path]) -> dict:
    tree: dict = {}
    for path in paths:
        node = tree
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return tree


def from_fields_v1(tree: dict, prefix: Path = ()) -> set[Path]:
    if not tree:
        return {prefix} if prefix else set()
    return {p for key, sub in tree.items() if key.startswith("f:") for p in from_fields_v1(sub, (*prefix, key[2:]))}


def owned(entries: list[dict]) -> dict[tuple[str, str], set[Path]]:
    """(manager, operation) -> the ``spec`` paths it owns, from ``managedFields``."""
    out: dict[tuple[str, str], set[Path]] = {}
    for entry in entries or []:
        spec = (entry.get("fieldsV1") or {}).get("f:spec") or {}
        out[(entry.get("manager", ""), entry.get("operation", "Update"))] = from_fields_v1(spec)
    return out


def record_write(
    old: dict | None, written_spec: dict, manager: str, apply: bool, api_version: str
) -> tuple[list[dict], list[Path]]:
    """The object's new ``managedFields`` after ``manager`` wrote ``written_spec``, and the spec paths to
    remove from the object (an applier's dropped fields nobody else owns)."""
    before = owned(((old or {}).get("metadata") or {}).get("managedFields") or [])
    written = leaf_paths(written_spec)
    key = (manager, "Apply" if apply else "Update")
    dropped = before.get(key, set()) - written if apply else set()
    after = {k: {p for p in paths if not _covers(written, p)} for k, paths in before.items() if k != key}
    after[key] = written if apply else before.get(key, set()) | written
    still = set().union(*after.values()) if after else set()
    removed = [p for p in dropped if not any(_covers({q}, p) or _covers({p}, q) for q in still)]
    entries = [
        {
            "manager": manager,
            "operation": operation,
            "apiVersion": api_version,
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:spec": to_fields_v1(paths)},
        }
        for (manager, operation), paths in after.items()
        if paths
    ]
    return entries, removed


def _covers(paths: set[Path], path: Path) -> bool:
    """Whether ``path`` is one of ``paths`` or inside one of them."""
    return any(path[: len(p)] == p for p in paths)


def without(obj: dict, paths: list[Path]) -> dict:
    """``obj`` with the ``spec`` leaf ``paths`` removed (and mappings they leave empty)."""
    obj = copy.deepcopy(obj)
    for path in paths:
        _remove(obj.get("spec") or {}, path)
    return obj


def _remove(node: dict, path: Path) -> None:
    if len(path) == 1:
        node.pop(path[0], None)
        return
    child = node.get(path[0])
    if isinstance(child, dict):
        _remove(child, path[1:])
        if not child:
            node.pop(path[0], None)
