"""The API server emulator behaves like kube-apiserver where kopf, kubectl and the operator depend on it."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.k8s.api_rules import label_selector_matches, parse_k8s_path
from tests.k8s.server import EmulatedCluster, call

CM = "/api/v1/namespaces/ns/configmaps"
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.com"},
    "spec": {
        "group": "example.com",
        "scope": "Namespaced",
        "names": {"kind": "Widget", "plural": "widgets", "singular": "widget", "shortNames": ["wg"]},
        "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}}}],
    },
}
WIDGETS = "/apis/example.com/v1/namespaces/ns/widgets"


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster() as c:
        for namespace in ("ns", "other"):
            assert call(c, "POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})[0] == 201
        yield c


def test_created_objects_get_server_metadata(cluster: EmulatedCluster) -> None:
    code, obj = call(cluster, "POST", CM, {"metadata": {"name": "meta"}, "data": {"a": "1"}})
    assert code == 201
    meta = obj["metadata"]
    assert meta["namespace"] == "ns" and meta["generation"] == 1 and meta["uid"] and meta["creationTimestamp"]
    assert int(meta["resourceVersion"]) > 0
    assert call(cluster, "POST", CM, {"metadata": {"name": "meta"}})[0] == 409


def test_generate_name_makes_a_unique_name(cluster: EmulatedCluster) -> None:
    _, first = call(cluster, "POST", "/api/v1/namespaces/ns/events", {"metadata": {"generateName": "ev-"}})
    _, second = call(cluster, "POST", "/api/v1/namespaces/ns/events", {"metadata": {"generateName": "ev-"}})
    assert (
        first["metadata"]["name"].startswith("ev-")
        and first["metadata"]["name"] != second["metadata"]["name"]
    )


def test_a_failed_json_patch_test_is_422_and_changes_nothing(cluster: EmulatedCluster) -> None:
    _, obj = call(cluster, "POST", CM, {"metadata": {"name": "jp"}, "data": {"a": "1"}})
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "stale"},
        {"op": "replace", "path": "/data/a", "value": "2"},
    ]
    code, status = call(cluster, "PATCH", f"{CM}/jp", ops, "application/json-patch+json")
    assert (code, status["reason"]) == (422, "Invalid")
    ops[0]["value"] = obj["metadata"]["resourceVersion"]
    code, patched = call(cluster, "PATCH", f"{CM}/jp", ops, "application/json-patch+json")
    assert code == 200 and patched["data"] == {"a": "2"}


def test_a_stale_resource_version_in_a_merge_patch_is_a_conflict(cluster: EmulatedCluster) -> None:
    call(cluster, "POST", CM, {"metadata": {"name": "rv"}, "data": {"a": "1"}})
    code, status = call(
        cluster,
        "PATCH",
        f"{CM}/rv",
        {"metadata": {"resourceVersion": "1"}, "data": {"a": "2"}},
        "application/merge-patch+json",
    )
    assert (code, status["reason"]) == (409, "Conflict")


def test_a_no_op_patch_bumps_nothing(cluster: EmulatedCluster) -> None:
    _, obj = call(cluster, "POST", CM, {"metadata": {"name": "noop"}, "data": {"a": "1"}})
    _, same = call(cluster, "PATCH", f"{CM}/noop", {"data": {"a": "1"}}, "application/merge-patch+json")
    assert same["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]


def test_strategic_merge_directives_are_dropped(cluster: EmulatedCluster) -> None:
    call(cluster, "POST", CM, {"metadata": {"name": "smp"}, "data": {"a": "1"}})
    patch = {"$setElementOrder/data": [], "data": {"b": "2"}}
    _, obj = call(cluster, "PATCH", f"{CM}/smp", patch, "application/strategic-merge-patch+json")
    assert obj["data"] == {"a": "1", "b": "2"}


def test_crds_become_discoverable_and_status_is_a_separate_subresource(cluster: EmulatedCluster) -> None:
    assert call(cluster, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", CRD)[0] == 201
    _, discovery = call(cluster, "GET", "/apis/example.com/v1")
    names = {r["name"]: r for r in discovery["resources"]}
    assert names["widgets"]["namespaced"] is True and names["widgets"]["shortNames"] == ["wg"]
    assert "widgets/status" in names

    _, obj = call(
        cluster,
        "POST",
        WIDGETS,
        {
            "apiVersion": "example.com/v1",
            "kind": "Widget",
            "metadata": {"name": "w"},
            "spec": {"size": 1},
            "status": {"ignored": True},
        },
    )
    assert "status" not in obj
    _, obj = call(
        cluster,
        "PATCH",
        f"{WIDGETS}/w/status",
        {"spec": {"size": 9}, "status": {"ok": True}},
        "application/merge-patch+json",
    )
    assert (obj["spec"], obj["status"], obj["metadata"]["generation"]) == ({"size": 1}, {"ok": True}, 1)
    _, obj = call(
        cluster,
        "PATCH",
        f"{WIDGETS}/w",
        {"spec": {"size": 2}, "status": {"ok": False}},
        "application/merge-patch+json",
    )
    assert (obj["spec"], obj["status"], obj["metadata"]["generation"]) == ({"size": 2}, {"ok": True}, 2)


def test_a_namespace_must_exist_before_objects_are_created_in_it(cluster: EmulatedCluster) -> None:
    code, status = call(cluster, "POST", "/api/v1/namespaces/nowhere/configmaps", {"metadata": {"name": "c"}})
    assert (code, status["reason"], status["message"]) == (404, "NotFound", 'namespaces "nowhere" not found')
    assert (
        call(cluster, "POST", "/api/v1/namespaces/default/configmaps", {"metadata": {"name": "c"}})[0] == 201
    )


def test_core_discovery_reports_group_version_v1(cluster: EmulatedCluster) -> None:
    assert call(cluster, "GET", "/api/v1")[1]["groupVersion"] == "v1"


def test_finalizers_hold_deletion_until_removed(cluster: EmulatedCluster) -> None:
    call(cluster, "POST", CM, {"metadata": {"name": "fin", "finalizers": ["x/y"]}})
    _, marked = call(cluster, "DELETE", f"{CM}/fin")
    assert marked["metadata"]["deletionTimestamp"]
    assert call(cluster, "GET", f"{CM}/fin")[0] == 200
    call(cluster, "PATCH", f"{CM}/fin", {"metadata": {"finalizers": None}}, "application/merge-patch+json")
    assert call(cluster, "GET", f"{CM}/fin")[0] == 404


def test_lists_carry_kind_and_resource_version_and_honour_label_selectors(cluster: EmulatedCluster) -> None:
    call(cluster, "POST", CM, {"metadata": {"name": "l1", "labels": {"app": "a", "tier": "x"}}})
    call(cluster, "POST", CM, {"metadata": {"name": "l2", "labels": {"app": "b"}}})
    _, listing = call(cluster, "GET", f"{CM}?labelSelector=app%3Da")
    assert (
        listing["kind"] == "ConfigMapList"
        and listing["apiVersion"] == "v1"
        and listing["metadata"]["resourceVersion"]
    )
    assert [o["metadata"]["name"] for o in listing["items"]] == ["l1"]


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("app=a", True),
        ("app==a,tier", True),
        ("app!=a", False),
        ("!tier", False),
        ("app in (a, b)", True),
        ("app notin (a)", False),
        ("zone", False),
    ],
)
def test_label_selector_terms(selector: str, expected: bool) -> None:
    assert label_selector_matches(selector, {"app": "a", "tier": "x"}) is expected


def test_watch_from_a_resource_version_replays_later_events_as_json_lines(cluster: EmulatedCluster) -> None:
    _, listing = call(cluster, "GET", CM)
    since = listing["metadata"]["resourceVersion"]
    call(cluster, "POST", CM, {"metadata": {"name": "w1"}})
    call(cluster, "PATCH", f"{CM}/w1", {"data": {"x": "1"}}, "application/merge-patch+json")
    url = f"{cluster.url}{CM}?watch=true&resourceVersion={since}&timeoutSeconds=1"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("application/json")
        events = [json.loads(line) for line in response.read().splitlines()]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "w1"),
        ("MODIFIED", "w1"),
    ]


def test_a_watch_without_resource_version_starts_with_the_current_objects_then_streams(
    cluster: EmulatedCluster,
) -> None:
    call(cluster, "POST", "/api/v1/namespaces/other/configmaps", {"metadata": {"name": "a-before"}})
    received: list[dict[str, Any]] = []

    def watch() -> None:
        with urllib.request.urlopen(
            f"{cluster.url}/api/v1/namespaces/other/configmaps?watch=true&timeoutSeconds=2", timeout=10
        ) as response:
            received.extend(json.loads(line) for line in response.read().splitlines())

    watcher = threading.Thread(target=watch)
    watcher.start()
    call(cluster, "POST", "/api/v1/namespaces/other/configmaps", {"metadata": {"name": "b-after"}})
    watcher.join(10)
    assert [e["object"]["metadata"]["name"] for e in received] == ["a-before", "b-after"]


def test_paths_map_to_resources_including_namespaces_themselves() -> None:
    namespaces, ns, name, sub = parse_k8s_path("/api/v1/namespaces")
    assert (namespaces.plural, ns, name, sub) == ("namespaces", None, None, None)
    assert parse_k8s_path("/api/v1/namespaces/team")[2] == "team"
    sts, ns, name, sub = parse_k8s_path("/apis/apps/v1/namespaces/a/statefulsets/s/status")
    assert (sts.group, sts.plural, ns, name, sub) == ("apps", "statefulsets", "a", "s", "status")
    assert parse_k8s_path("/version")[0] is None
