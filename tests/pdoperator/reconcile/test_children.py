"""The write plan: create the missing, patch the drifted, delete the controlled leftovers, leave the rest."""

from __future__ import annotations

from pdoperator.reconcile.children import Create, Delete, Patch, plan
from pdoperator.reconcile.diff import with_last_applied
from pdoperator.reconcile.kinds import CONFIGMAPS, SERVICES

OWNER = [
    {
        "apiVersion": "inference.pdoperator.dev/v1alpha1",
        "kind": "PDService",
        "name": "x",
        "uid": "u1",
        "controller": True,
    }
]


def cm(name: str, data: dict[str, str], owners: list[dict] | None = None) -> dict:
    meta = {"name": name, "namespace": "ns", "ownerReferences": owners if owners is not None else OWNER}
    return with_last_applied({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})


def test_missing_children_are_created_in_render_order() -> None:
    desired = [cm("a", {}), cm("b", {})]
    assert [(type(a), a.name) for a in plan(desired, {}, "u1")] == [(Create, "a"), (Create, "b")]


def test_a_drifted_child_gets_a_patch_of_only_the_difference() -> None:
    live = cm("a", {"k": "old"})
    (action,) = plan([cm("a", {"k": "new"})], {CONFIGMAPS: [live]}, "u1")
    assert isinstance(action, Patch)
    assert action.patch["data"] == {"k": "new"}


def test_children_no_longer_rendered_are_deleted_only_when_this_pdservice_controls_them() -> None:
    ours = cm("old", {})
    someone_elses = cm("foreign", {}, owners=[{**OWNER[0], "uid": "other"}])
    unowned = cm("manual", {}, owners=[])
    actions = plan([], {CONFIGMAPS: [ours, someone_elses, unowned], SERVICES: []}, "u1")
    assert actions == [Delete(CONFIGMAPS, "old")]


def test_a_child_being_deleted_is_left_to_finish() -> None:
    live = cm("a", {"k": "old"})
    live["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert plan([cm("a", {"k": "new"})], {CONFIGMAPS: [live]}, "u1") == []
