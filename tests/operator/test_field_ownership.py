"""The emulator's server-side-apply field ownership: what it removes, keeps and transfers."""

from __future__ import annotations

from field_ownership import leaf_paths, owned, record_write, without


def apply(obj, spec, manager, apply=True):
    entries, removed = record_write(obj, spec, manager, apply, "apps/v1")
    new = without(obj or {"spec": {}}, removed)
    new.setdefault("spec", {}).update(spec)  # NOTE: a shallow merge is enough for these specs
    new.setdefault("metadata", {})["managedFields"] = entries
    return new


def test_a_field_its_only_applier_drops_is_removed():
    obj = apply(None, {"replicas": 3, "paused": False}, "op")
    obj = apply(obj, {"paused": False}, "op")
    assert "replicas" not in obj["spec"]


def test_a_field_another_manager_also_applies_is_kept():
    obj = apply(None, {"replicas": 3, "paused": False}, "op")
    obj = apply(obj, {"replicas": 3}, "handover")
    obj = apply(obj, {"paused": False}, "op")
    assert obj["spec"]["replicas"] == 3
    assert owned(obj["metadata"]["managedFields"])[("handover", "Apply")] == {("replicas",)}


def test_an_update_takes_the_field_from_the_applier():
    obj = apply(None, {"replicas": 3, "paused": False}, "op")
    obj = apply(obj, {"replicas": 5}, "hpa", apply=False)
    managers = owned(obj["metadata"]["managedFields"])
    assert managers[("op", "Apply")] == {("paused",)} and managers[("hpa", "Update")] == {("replicas",)}
    obj = apply(obj, {"paused": False}, "op")  # the operator no longer applies replicas: the hpa's stay
    assert obj["spec"]["replicas"] == 5


def test_nested_fields_and_lists():
    spec = {"template": {"spec": {"containers": [{"name": "a"}]}}, "selector": {"matchLabels": {"a": "1"}}}
    assert leaf_paths(spec) == {("template", "spec", "containers"), ("selector", "matchLabels", "a")}
    obj = apply(None, spec, "op")
    obj = apply(obj, {"selector": {"matchLabels": {"a": "1"}}}, "op")
    assert "template" not in obj["spec"]
