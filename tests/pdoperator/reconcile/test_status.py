"""Status and conditions from the children's own status."""

from __future__ import annotations

from pdoperator.api.model import PDService, PDServiceSpec
from pdoperator.api.status import Condition, ConditionStatus, ConditionType, PDServiceStatus, Phase
from pdoperator.reconcile.status import healthy_status, invalid_status, role_rollout, status_patch
from pdoperator.render import ComponentRole

PDS = PDService(
    name="tiny",
    namespace="ns",
    spec=PDServiceSpec.model_validate({"model": {"name": "m"}}),
    generation=3,
    uid="u",
)


def workload(generation: int = 1, **status: int | str) -> dict:
    return {"metadata": {"generation": generation}, "spec": {}, "status": status}


def ready(role: ComponentRole, n: int = 1):
    return role_rollout(
        role, n, workload(observedGeneration=1, replicas=n, readyReplicas=n, updatedReplicas=n)
    )


def compute(rollouts, previous=None, kv=None, now="T1") -> PDServiceStatus:
    return healthy_status(
        PDS,
        rollouts,
        previous=previous or PDServiceStatus(),
        kv_condition=kv,
        cluster_domain="cluster.local",
        now=now,
    )


def cond(status: PDServiceStatus, type_: ConditionType) -> Condition:
    return next(c for c in status.conditions if c.type == type_)


def test_a_missing_workload_is_not_ready_and_not_rolled_out() -> None:
    r = role_rollout(ComponentRole.DECODE, 2, None)
    assert (r.ready, r.rolled_out, r.summary) == (0, False, "0/2")


def test_a_workload_whose_controller_has_not_seen_the_new_generation_is_still_rolling_out() -> None:
    r = role_rollout(
        ComponentRole.PREFILL,
        1,
        workload(generation=2, observedGeneration=1, replicas=1, readyReplicas=1, updatedReplicas=1),
    )
    assert not r.rolled_out and r.ready == 1


def test_statefulset_revisions_must_match_to_count_as_rolled_out() -> None:
    r = role_rollout(
        ComponentRole.PREFILL,
        1,
        workload(
            observedGeneration=1,
            replicas=1,
            readyReplicas=1,
            updatedReplicas=1,
            currentRevision="a",
            updateRevision="b",
        ),
    )
    assert not r.rolled_out


def test_every_role_ready_is_phase_ready_with_summaries_and_endpoint() -> None:
    status = compute(
        [ready(ComponentRole.PREFILL), ready(ComponentRole.DECODE, 2), ready(ComponentRole.ROUTER)]
    )
    assert status.phase == Phase.READY
    assert (status.decode.summary, status.decode.ready_replicas, status.decode.desired_replicas) == (
        "2/2",
        2,
        2,
    )
    assert status.router_endpoint == "http://tiny-router.ns.svc.cluster.local:8000"
    assert status.observed_generation == 3
    assert cond(status, ConditionType.READY).status == ConditionStatus.TRUE
    assert all(c.observed_generation == 3 for c in status.conditions)


def test_nothing_reported_yet_is_pending_then_progressing() -> None:
    missing = [
        role_rollout(role, 1, None)
        for role in (ComponentRole.PREFILL, ComponentRole.DECODE, ComponentRole.ROUTER)
    ]
    assert compute(missing).phase == Phase.PENDING
    some = [
        ready(ComponentRole.PREFILL),
        role_rollout(ComponentRole.DECODE, 1, None),
        role_rollout(ComponentRole.ROUTER, 1, None),
    ]
    status = compute(some)
    assert status.phase == Phase.PROGRESSING
    assert cond(status, ConditionType.PROGRESSING).message == "rolling out: decode, router"


def test_a_finished_rollout_with_missing_replicas_is_degraded() -> None:
    stalled = role_rollout(
        ComponentRole.DECODE,
        2,
        workload(observedGeneration=1, replicas=2, readyReplicas=1, updatedReplicas=2),
    )
    status = compute([ready(ComponentRole.PREFILL), stalled, ready(ComponentRole.ROUTER)])
    assert status.phase == Phase.DEGRADED
    degraded = cond(status, ConditionType.DEGRADED)
    assert (degraded.status, degraded.reason) == (ConditionStatus.TRUE, "ReplicasUnavailable")
    assert "decode 1/2" in degraded.message


def test_last_transition_time_moves_only_when_the_status_changes() -> None:
    roles = [ready(ComponentRole.PREFILL), ready(ComponentRole.DECODE), ready(ComponentRole.ROUTER)]
    first = compute(roles, now="T1")
    again = compute(roles, previous=first, now="T2")
    assert cond(again, ConditionType.READY).last_transition_time == "T1"
    broken = compute([role_rollout(ComponentRole.PREFILL, 1, None), *roles[1:]], previous=again, now="T3")
    assert cond(broken, ConditionType.READY).last_transition_time == "T3"
    assert cond(broken, ConditionType.SPEC_VALID).last_transition_time == "T1"


def test_serving_without_transfer_degrades_the_service() -> None:
    kv = Condition(
        type=ConditionType.KV_TRANSFER_VERIFIED,
        status=ConditionStatus.FALSE,
        reason="ServedWithoutTransfer",
        message="m",
    )
    status = compute(
        [ready(ComponentRole.PREFILL), ready(ComponentRole.DECODE), ready(ComponentRole.ROUTER)], kv=kv
    )
    assert status.phase == Phase.DEGRADED
    assert cond(status, ConditionType.DEGRADED).reason == "ServedWithoutTransfer"
    assert cond(status, ConditionType.KV_TRANSFER_VERIFIED) == kv


def test_an_invalid_spec_changes_only_spec_valid_phase_and_generation() -> None:
    good = compute([ready(ComponentRole.PREFILL), ready(ComponentRole.DECODE), ready(ComponentRole.ROUTER)])
    bad = invalid_status(4, good, "spec.x: wrong", "T9")
    assert bad.phase == Phase.INVALID and bad.observed_generation == 4
    spec_valid = cond(bad, ConditionType.SPEC_VALID)
    assert (spec_valid.status, spec_valid.reason, spec_valid.message) == (
        ConditionStatus.FALSE,
        "InvalidSpec",
        "spec.x: wrong",
    )
    assert cond(bad, ConditionType.READY) == cond(good, ConditionType.READY)
    assert bad.decode == good.decode


def test_status_patch_is_none_when_nothing_changed_and_ignores_foreign_keys() -> None:
    status = compute([ready(ComponentRole.PREFILL), ready(ComponentRole.DECODE), ready(ComponentRole.ROUTER)])
    patch = status_patch({"kopf": {"x": 1}}, status)
    assert patch is not None
    stored = {**patch["status"], "kopf": {"x": 1}}
    assert status_patch(stored, status) is None
