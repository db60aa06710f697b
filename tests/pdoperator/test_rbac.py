"""The operator's RBAC rules as data (the chart renders them; integration tests check the calls against
them)."""

from __future__ import annotations

from pdoperator.rbac import CLUSTER_RULES, NAMESPACED_RULES, is_granted, rbac_rules_document
from pdoperator.reconcile.kinds import CHILD_KINDS, WATCHED_CHILD_KINDS


def test_every_child_kind_can_be_listed_created_patched_and_deleted() -> None:
    for kind in CHILD_KINDS:
        for verb in ("list", "create", "patch", "delete"):
            assert is_granted(verb, kind.group, kind.plural), (verb, kind.plural)


def test_only_watched_children_may_be_watched() -> None:
    watchable = {kind.plural for kind in CHILD_KINDS if is_granted("watch", kind.group, kind.plural)}
    assert watchable == {kind.plural for kind in WATCHED_CHILD_KINDS}


def test_the_status_subresource_is_granted_apart_from_the_resource() -> None:
    assert is_granted("patch", "inference.pdoperator.dev", "pdservices/status")
    assert not is_granted("update", "inference.pdoperator.dev", "pdservices")
    assert not is_granted("delete", "inference.pdoperator.dev", "pdservices")


def test_nothing_beyond_what_the_operator_calls() -> None:
    assert not is_granted("get", "", "secrets")
    assert not is_granted("list", "", "pods")
    assert not is_granted("delete", "", "events")


def test_cluster_and_namespaced_rules_do_not_overlap_and_render_as_policy_rules() -> None:
    cluster = {r for rule in CLUSTER_RULES for r in rule.resources}
    namespaced = {r for rule in NAMESPACED_RULES for r in rule.resources}
    assert not cluster & namespaced
    document = rbac_rules_document()
    assert set(document) == {"cluster", "namespaced"}
    assert all(
        set(rule) == {"apiGroups", "resources", "verbs"} for rules in document.values() for rule in rules
    )
