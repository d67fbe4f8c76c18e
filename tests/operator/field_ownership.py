"""Server-side apply's field ownership, for the emulated API server.

What the operator's replica hand-over and its labels depend on, as the API server does it:

- each write records which leaf fields its field manager set, in ``metadata.managedFields``
  (``fieldsV1``), with operation ``Apply`` (server-side apply) or ``Update`` (any other write,
  a ``/scale`` write among them). Owned are the fields of :func:`tracked`: every top-level
  field but ``status`` (``spec``, a ConfigMap's ``data``, a Role's ``rules``) and
  ``metadata.labels`` / ``metadata.annotations``, each label or annotation on its own;
- a field a manager sets is taken from every other manager. An update always takes it; an
  apply with ``force`` too, and one without is refused where another manager owns a field it
  sets to a different value (:func:`conflicts`, a 409 from the server); setting the same
  value makes the two managers share the field;
- a field that an ``Apply`` manager set before and no longer applies is removed from the
  object, unless another manager still owns it;
- lists the schema marks ``x-kubernetes-list-type: map`` (containers, env, ports, volumes,
  ... by their ``x-kubernetes-list-map-keys``) are merged item by item: each item is owned
  as ``k:{"name":"server"}`` with a ``.`` entry of its own, an apply merges its items into
  the list (:func:`merge_applied`) and removes only the items it dropped that nobody else
  owns a field of. Other lists are single fields (atomic), replaced by each write.

Paths start at the object's root (``("spec", "replicas")``, ``("metadata", "labels", "team")``).
``keys`` maps a keyed list's path from the object's root (``("spec", "template", "spec",
"containers")``, ``"[]"`` standing for the items of an outer list) to its key fields, as
:meth:`api_schemas.ApiSchemas.list_keys` gives them.
"""

from __future__ import annotations

import copy
import json
from typing import Any

Path = tuple[str, ...]
Keys = dict[Path, tuple[str, ...]]
ITEM = "."  # the entry that owns a keyed list item itself
UNOWNED = ("apiVersion", "kind", "metadata", "status")
OWNED_METADATA = ("labels", "annotations")


def tracked(obj: dict) -> dict:
    """The part of ``obj`` (a write's body) whose fields have owners."""
    out = {k: v for k, v in obj.items() if k not in UNOWNED}
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k in OWNED_METADATA and isinstance(v, dict)}
    if meta:
        out["metadata"] = meta
    return out


def item_key(item: dict, keys: tuple[str, ...]) -> str:
    return "k:" + json.dumps({k: item[k] for k in keys if k in item}, separators=(",", ":"))


def _keyed(value: Any, schema_path: Path, keys: Keys) -> tuple[str, ...] | None:
    wanted = keys.get(schema_path)
    if wanted and isinstance(value, list) and all(isinstance(i, dict) for i in value):
        return wanted
    return None


def leaf_paths(value: Any, prefix: Path = (), keys: Keys | None = None, schema_path: Path = ()) -> set[Path]:
    """The leaf fields of a (nested) mapping; keyed list items are owned one by one, other lists are leaves."""
    keys = keys or {}
    if isinstance(value, dict) and value:
        return {p for key, sub in value.items() for p in leaf_paths(sub, (*prefix, key), keys, (*schema_path, key))}
    item_keys = _keyed(value, schema_path, keys)
    if item_keys and value:
        out: set[Path] = set()
        for item in value:
            at = (*prefix, item_key(item, item_keys))
            out.add((*at, ITEM))
            out |= leaf_paths(item, at, keys, (*schema_path, "[]")) if item else set()
        return out
    return {prefix} if prefix else set()


def to_fields_v1(paths: set[Path]) -> dict:
    tree: dict = {}
    for path in paths:
        node = tree
        for key in path:
            node = node.setdefault(key if key.startswith("k:") or key == ITEM else f"f:{key}", {})
    return tree


def from_fields_v1(tree: dict, prefix: Path = ()) -> set[Path]:
    if not tree:
        return {prefix} if prefix else set()
    out: set[Path] = set()
    for key, sub in tree.items():
        if key == ITEM or key.startswith("k:"):
            out |= from_fields_v1(sub, (*prefix, key))
        elif key.startswith("f:"):
            out |= from_fields_v1(sub, (*prefix, key[2:]))
    return out


def owned(entries: list[dict]) -> dict[tuple[str, str], set[Path]]:
    """(manager, operation) -> the paths it owns, from ``managedFields``."""
    out: dict[tuple[str, str], set[Path]] = {}
    for entry in entries or []:
        out[(entry.get("manager", ""), entry.get("operation", "Update"))] = from_fields_v1(entry.get("fieldsV1") or {})
    return out


def record_write(
    old: dict | None, written_obj: dict, manager: str, apply: bool, api_version: str, keys: Keys | None = None
) -> tuple[list[dict], list[Path]]:
    """The object's new ``managedFields`` after ``manager`` wrote ``written_obj`` (its :func:`tracked`
    part), and the paths to remove from the object (an applier's dropped fields nobody else owns)."""
    before = owned(((old or {}).get("metadata") or {}).get("managedFields") or [])
    written_fields = tracked(written_obj)
    written = leaf_paths(written_fields, keys=keys)
    key = (manager, "Apply" if apply else "Update")
    dropped = before.get(key, set()) - written if apply else set()
    # A scalar or atomic list takes what was under it; an empty mapping only itself.
    taking = written - _empty_maps(written_fields)
    after = {
        k: {p for p in paths if not _covers(taking, p) and p not in written} for k, paths in before.items() if k != key
    }
    after[key] = written if apply else before.get(key, set()) | written
    still = set().union(*after.values()) if after else set()
    # Mappings owned as such (an applied ``{}``) hold nothing under them.
    still_covering = still - _empty_maps(written_fields) - {q for q in still if _is_map(old, q)}
    removed = [p for p in dropped if not _still_needed(p, still, still_covering)]
    entries = [
        {
            "manager": manager,
            "operation": operation,
            "apiVersion": api_version,
            "fieldsType": "FieldsV1",
            "fieldsV1": to_fields_v1(paths),
        }
        for (manager, operation), paths in after.items()
        if paths
    ]
    return entries, removed


def _empty_maps(value: Any, prefix: Path = ()) -> set[Path]:
    if isinstance(value, dict):
        if not value:
            return {prefix} if prefix else set()
        return {p for key, sub in value.items() for p in _empty_maps(sub, (*prefix, key))}
    return set()


def _is_map(obj: Any, path: Path) -> bool:
    node = obj
    for key in path:
        if isinstance(node, list) and key.startswith("k:"):
            index = _find(node, key)
            node = None if index is None else node[index]
        elif isinstance(node, dict):
            node = node.get(key)
        else:
            return False
    return isinstance(node, dict)


def _still_needed(path: Path, still: set[Path], covering: set[Path]) -> bool:
    """Whether another manager owns ``path``, a field inside it or around it, or (for an item) anything in it."""
    if path[-1] == ITEM:
        return any(q[: len(path) - 1] == path[:-1] for q in still)
    return _covers(covering, path) or any(_covers({path}, q) for q in still)


def _covers(paths: set[Path], path: Path) -> bool:
    """Whether ``path`` is one of ``paths`` or inside one of them."""
    return any(path[: len(p)] == p for p in paths)


def without(obj: dict, paths: list[Path]) -> dict:
    """``obj`` with the leaf ``paths`` removed (and mappings they leave empty)."""
    obj = copy.deepcopy(obj)
    # Whole items first (what was inside them goes with them); an item's key fields go only with it.
    for path in sorted(paths, key=lambda p: (p[-1] != ITEM, -len(p))):
        if len(path) > 1 and path[-2].startswith("k:") and path[-1] in json.loads(path[-2][2:]):
            continue
        _remove(obj, path)
    return obj


def _find(items: list, key: str) -> int | None:
    wanted = json.loads(key[2:])
    for index, item in enumerate(items):
        if isinstance(item, dict) and all(item.get(k) == v for k, v in wanted.items()):
            return index
    return None


def _remove(node: Any, path: Path) -> None:
    head, rest = path[0], path[1:]
    if isinstance(node, list):
        index = _find(node, head) if head.startswith("k:") else None
        if index is None:
            return
        if rest == (ITEM,):
            node.pop(index)
            return
        _remove(node[index], rest)
        return
    if not isinstance(node, dict):
        return
    if not rest:
        node.pop(head, None)
        return
    child = node.get(head)
    _remove(child, rest)
    if child in ({}, []):
        node.pop(head, None)


def merge_applied(old: Any, applied: Any, keys: Keys, schema_path: Path = ()) -> Any:
    """``applied`` merged into ``old`` as server-side apply does: mappings field by field, keyed lists item
    by item (items the apply leaves out stay, for :func:`record_write`'s removal to judge), other lists
    and scalars replaced."""
    if isinstance(old, dict) and isinstance(applied, dict):
        merged = copy.deepcopy(old)
        for name, value in applied.items():
            merged[name] = merge_applied(old.get(name), value, keys, (*schema_path, name))
        return merged
    item_keys = _keyed(applied, schema_path, keys)
    if item_keys and isinstance(old, list):
        merged_items = copy.deepcopy(old)
        for item in applied:
            index = _find(merged_items, item_key(item, item_keys))
            if index is None:
                merged_items.append(copy.deepcopy(item))
            else:
                merged_items[index] = merge_applied(merged_items[index], item, keys, (*schema_path, "[]"))
        return merged_items
    return copy.deepcopy(applied)


def value_at(obj: Any, path: Path) -> Any:
    """The value at ``path`` (keyed items found by their keys); :data:`MISSING` where there is none."""
    node = obj
    for key in path:
        if key == ITEM:
            return node
        if isinstance(node, list) and key.startswith("k:"):
            index = _find(node, key)
            if index is None:
                return MISSING
            node = node[index]
        elif isinstance(node, dict) and key in node:
            node = node[key]
        else:
            return MISSING
    return node


MISSING = object()


def conflicts(old: dict, written_obj: dict, manager: str, keys: Keys | None = None) -> list[tuple[str, Path]]:
    """(other manager, path) of each field an unforced apply of ``written_obj`` by ``manager`` would take:
    one another manager owns, set to a value other than the live one. Sorted, for a stable message."""
    written = tracked(written_obj)
    found = []
    for (other, _), paths in owned((old.get("metadata") or {}).get("managedFields") or []).items():
        if other == manager:
            continue
        for path in leaf_paths(written, keys=keys) & paths:
            if path[-1] != ITEM and value_at(written, path) != value_at(old, path):
                found.append((other, path))
    return sorted(found)


def dotted(path: Path) -> str:
    """``.spec.replicas``, ``.metadata.labels.team``, as the API server names a conflicting field."""
    return "".join(f"[{p[2:]}]" if p.startswith("k:") else f".{p}" for p in path)
