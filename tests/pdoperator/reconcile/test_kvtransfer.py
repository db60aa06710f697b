"""KVTransferVerified verdicts from the router's transfer counters."""

from __future__ import annotations

import pytest
from pdoperator.api.status import ConditionStatus
from pdoperator.reconcile.kvtransfer import (
    RouterStatusError,
    TransferCounts,
    Verdict,
    parse_router_status,
    verdict,
)

VERIFIED = Verdict(ConditionStatus.TRUE, "TransfersVerified", "ok")


def test_no_requests_yet_is_unknown_no_traffic() -> None:
    v = verdict(TransferCounts(0, 0), None, None)
    assert (v.status, v.reason) == (ConditionStatus.UNKNOWN, "NoTraffic")


def test_verified_requests_and_none_without_transfer_is_true() -> None:
    assert verdict(TransferCounts(3, 0), None, None).status == ConditionStatus.TRUE


def test_any_request_served_without_transfer_is_false_with_the_reason() -> None:
    v = verdict(TransferCounts(10, 1), None, None)
    assert (v.status, v.reason) == (ConditionStatus.FALSE, "ServedWithoutTransfer")


def test_verdicts_follow_new_requests_so_the_condition_recovers() -> None:
    assert verdict(TransferCounts(12, 1), TransferCounts(10, 1), None).status == ConditionStatus.TRUE
    assert verdict(TransferCounts(12, 2), TransferCounts(12, 1), VERIFIED).status == ConditionStatus.FALSE


def test_without_new_requests_the_previous_verdict_stands() -> None:
    assert verdict(TransferCounts(5, 0), TransferCounts(5, 0), VERIFIED) is VERIFIED


def test_a_router_restart_resets_the_baseline() -> None:
    assert verdict(TransferCounts(1, 0), TransferCounts(50, 3), None).status == ConditionStatus.TRUE


def test_requests_through_upstream_connectors_leave_the_condition_unknown_not_false() -> None:
    v = verdict(TransferCounts(0, 0, 7), None, None)
    assert (v.status, v.reason) == (ConditionStatus.UNKNOWN, "NotConfirmable")
    assert "spec.engine.connector" in v.message
    assert verdict(TransferCounts(0, 0, 9), TransferCounts(0, 0, 7), VERIFIED).reason == "NotConfirmable"
    assert verdict(TransferCounts(0, 0, 2), TransferCounts(0, 0, 7), None).reason == "NotConfirmable", (
        "router restarted"
    )


def test_router_status_payload_is_parsed() -> None:
    assert parse_router_status(
        {"transfers": {"verified": 2, "unverified": 1}, "mode": "push"}
    ) == TransferCounts(2, 1)
    assert parse_router_status(
        {"transfers": {"verified": 0, "unverified": 0, "unconfirmable": 4}}
    ) == TransferCounts(0, 0, 4)


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({}, "transfers"),
        ({"transfers": {"verified": -1, "unverified": 0}}, "transfers.verified"),
        ({"transfers": {"verified": 1, "unverified": "2"}}, "transfers.unverified"),
        ({"transfers": {"verified": True, "unverified": 0}}, "transfers.verified"),
        ({"transfers": {"verified": 1, "unverified": 0, "unconfirmable": None}}, "transfers.unconfirmable"),
        ([], "transfers"),
    ],
)
def test_a_malformed_router_status_names_the_field(payload: object, field: str) -> None:
    with pytest.raises(RouterStatusError, match=field.replace(".", r"\.")):
        parse_router_status(payload)
