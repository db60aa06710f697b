"""Desired-vs-live comparison and the three-way merge patch."""

from __future__ import annotations

import pytest
from pdoperator.reconcile.diff import (
    LAST_APPLIED_ANNOTATION,
    child_patch,
    is_subset,
    last_applied_of,
    merge_patch,
    with_last_applied,
)


@pytest.mark.parametrize(
    ("desired", "live"),
    [
        ({"a": 1}, {"a": 1, "server": "default"}),
        ({"spec": {"ports": [{"port": 80}]}}, {"spec": {"ports": [{"port": 80, "protocol": "TCP"}]}}),
        ({"nodeSelector": {}}, {}),
        ({"tolerations": []}, {"tolerations": None}),
        ({"x": None}, {"x": "anything"}),
    ],
)
def test_desired_fields_present_in_live_are_a_subset(desired: dict, live: dict) -> None:
    assert is_subset(desired, live)


@pytest.mark.parametrize(
    ("desired", "live"),
    [
        ({"a": 1}, {"a": 2}),
        ({"a": 1}, {}),
        ({"ports": [{"port": 80}]}, {"ports": [{"port": 80}, {"port": 81}]}),
        ({"args": ["--a", "--b"]}, {"args": ["--b", "--a"]}),
        ({"tolerations": []}, {"tolerations": [{"key": "x"}]}),
        ({"m": {"k": "v"}}, {"m": "scalar"}),
    ],
)
def test_a_changed_missing_or_reordered_field_is_not_a_subset(desired: dict, live: dict) -> None:
    assert not is_subset(desired, live)


def test_merge_patch_touches_only_what_differs_and_replaces_whole_lists() -> None:
    live = {
        "spec": {
            "replicas": 1,
            "template": {"containers": [{"name": "e", "image": "a", "imagePullPolicy": "Always"}]},
            "extra": 1,
        }
    }
    desired = {"spec": {"replicas": 2, "template": {"containers": [{"name": "e", "image": "b"}]}}}
    assert merge_patch({}, desired, live) == {
        "spec": {"replicas": 2, "template": {"containers": [{"name": "e", "image": "b"}]}}
    }


def test_merge_patch_nulls_keys_applied_before_and_no_longer_desired() -> None:
    last = {"spec": {"nodeSelector": {"pool": "gpu", "zone": "a"}}}
    live = {"spec": {"nodeSelector": {"pool": "gpu", "zone": "a"}, "serverSide": True}}
    desired = {"spec": {"nodeSelector": {"pool": "gpu"}}}
    assert merge_patch(last, desired, live) == {"spec": {"nodeSelector": {"zone": None}}}


def test_merge_patch_is_empty_when_live_already_matches() -> None:
    desired = {"metadata": {"labels": {"a": "b"}}, "data": {"k": "v"}}
    live = {"metadata": {"labels": {"a": "b"}, "uid": "u", "resourceVersion": "7"}, "data": {"k": "v"}}
    assert merge_patch(desired, desired, live) == {}


def test_the_last_applied_annotation_round_trips_and_is_part_of_the_desired_state() -> None:
    desired = {"metadata": {"name": "x"}, "data": {"k": "v"}}
    stamped = with_last_applied(desired)
    assert last_applied_of(stamped) == desired
    assert LAST_APPLIED_ANNOTATION in stamped["metadata"]["annotations"]
    assert "annotations" not in desired["metadata"]  # the input is not mutated


def test_an_unreadable_last_applied_annotation_counts_as_nothing_applied() -> None:
    assert last_applied_of({"metadata": {"annotations": {LAST_APPLIED_ANNOTATION: "{not json"}}}) == {}


def test_exclusive_maps_lose_hand_added_keys() -> None:
    desired = with_last_applied({"metadata": {"name": "cm"}, "data": {"config.json": "{}"}})
    live = {**desired, "data": {"config.json": "{}", "added": "by hand"}}
    assert child_patch(desired, live) == {}
    assert child_patch(desired, live, exclusive=[("data",)]) == {"data": {"added": None}}
