"""The emulator's server-side-apply field ownership: what it removes, keeps and transfers."""

from __future__ import annotations

from field_ownership import (
    conflicts,
    dotted,
    from_fields_v1,
    leaf_paths,
    merge_applied,
    owned,
    record_write,
    to_fields_v1,
    tracked,
    without,
)


def apply(obj, spec, manager, apply=True):
    entries, removed = record_write(obj, {"spec": spec}, manager, apply, "apps/v1")
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
    assert owned(obj["metadata"]["managedFields"])[("handover", "Apply")] == {("spec", "replicas")}


def test_an_update_takes_the_field_from_the_applier():
    obj = apply(None, {"replicas": 3, "paused": False}, "op")
    obj = apply(obj, {"replicas": 5}, "hpa", apply=False)
    managers = owned(obj["metadata"]["managedFields"])
    assert managers[("op", "Apply")] == {("spec", "paused")} and managers[("hpa", "Update")] == {("spec", "replicas")}
    obj = apply(obj, {"paused": False}, "op")  # the operator no longer applies replicas: the hpa's stay
    assert obj["spec"]["replicas"] == 5


def test_nested_fields_and_lists():
    spec = {"template": {"spec": {"containers": [{"name": "a"}]}}, "selector": {"matchLabels": {"a": "1"}}}
    assert leaf_paths(spec) == {("template", "spec", "containers"), ("selector", "matchLabels", "a")}
    obj = apply(None, spec, "op")
    obj = apply(obj, {"selector": {"matchLabels": {"a": "1"}}}, "op")
    assert "template" not in obj["spec"]


KEYS = {
    ("spec", "template", "spec", "containers"): ("name",),
    ("spec", "template", "spec", "containers", "[]", "env"): ("name",),
}


def pod_spec(*containers):
    return {"template": {"spec": {"containers": list(containers)}}}


def apply_keyed(obj, spec, manager):
    entries, removed = record_write(obj, {"spec": spec}, manager, True, "apps/v1", KEYS)
    new = without(obj or {"spec": {}}, removed)
    new["spec"] = merge_applied(new.get("spec") or {}, spec, KEYS, ("spec",))
    new.setdefault("metadata", {})["managedFields"] = entries
    return new


def test_keyed_list_items_are_owned_one_by_one():
    paths = leaf_paths({"spec": pod_spec({"name": "a", "image": "i", "env": [{"name": "X", "value": "1"}]})}, keys=KEYS)
    item = ("spec", "template", "spec", "containers", 'k:{"name":"a"}')
    assert paths == {(*item, "."), (*item, "name"), (*item, "image"), (*item, "env", 'k:{"name":"X"}', "."),
                     (*item, "env", 'k:{"name":"X"}', "name"), (*item, "env", 'k:{"name":"X"}', "value")}  # fmt: skip
    assert from_fields_v1(to_fields_v1(paths)) == paths
    assert 'k:{"name":"a"}' in to_fields_v1(paths)["f:spec"]["f:template"]["f:spec"]["f:containers"]


def test_two_appliers_merge_a_keyed_list_and_each_removes_only_its_own_items():
    obj = apply_keyed(None, pod_spec({"name": "server", "image": "v1"}), "op")
    obj = apply_keyed(obj, pod_spec({"name": "sidecar", "image": "proxy"}), "mesh")
    assert [c["name"] for c in obj["spec"]["template"]["spec"]["containers"]] == ["server", "sidecar"]
    # The operator re-applies its container with a new image and an env var: the sidecar stays.
    obj = apply_keyed(obj, pod_spec({"name": "server", "image": "v2", "env": [{"name": "X", "value": "1"}]}), "op")
    server, sidecar = obj["spec"]["template"]["spec"]["containers"]
    assert (server["image"], server["env"]) == ("v2", [{"name": "X", "value": "1"}])
    assert sidecar == {"name": "sidecar", "image": "proxy"}
    # The mesh stops applying its sidecar: removed; the operator's container untouched.
    obj = apply_keyed(obj, {"template": {"spec": {}}}, "mesh")
    assert [c["name"] for c in obj["spec"]["template"]["spec"]["containers"]] == ["server"]


def test_an_item_another_manager_owns_a_field_of_stays():
    obj = apply_keyed(None, pod_spec({"name": "server", "image": "v1"}), "op")
    obj = apply_keyed(obj, pod_spec({"name": "server", "env": [{"name": "INJECTED", "value": "1"}]}), "mesh")
    obj = apply_keyed(obj, {"template": {"spec": {}}}, "op")  # the operator drops its container
    (server,) = obj["spec"]["template"]["spec"]["containers"]
    assert server == {"name": "server", "env": [{"name": "INJECTED", "value": "1"}]}  # image went with its owner


def test_labels_and_other_top_level_fields_are_owned_but_not_status_or_the_rest_of_metadata():
    written = {
        "metadata": {"name": "x", "labels": {"a": "1"}, "annotations": {"n": "v"}, "resourceVersion": "3"},
        "data": {"k": "v"},
        "status": {"phase": "Ready"},
    }
    paths = leaf_paths(tracked(written))
    assert paths == {("metadata", "labels", "a"), ("metadata", "annotations", "n"), ("data", "k")}
    assert to_fields_v1(paths)["f:metadata"] == {"f:labels": {"f:a": {}}, "f:annotations": {"f:n": {}}}


def test_a_conflict_is_another_managers_field_set_to_another_value():
    obj = {"metadata": {"labels": {"a": "1", "b": "1"}}, "spec": {"replicas": 2}}
    entries, _ = record_write(None, obj, "op", True, "apps/v1")
    obj["metadata"]["managedFields"] = entries
    wanted = {"metadata": {"labels": {"a": "1", "b": "2"}}, "spec": {"replicas": 3, "paused": True}}
    assert conflicts(obj, wanted, "hand") == [("op", ("metadata", "labels", "b")), ("op", ("spec", "replicas"))]
    assert conflicts(obj, wanted, "op") == []  # its own fields
    assert dotted(("spec", "template", "spec", "containers", 'k:{"name":"a"}', "image")) == (
        '.spec.template.spec.containers[{"name":"a"}].image'
    )
