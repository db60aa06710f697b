"""The PDService status, computed from the spec and the children's own status (pure).

Kubernetes condition conventions: one condition per type, ``lastTransitionTime`` moves only
when ``status`` changes, every condition carries the generation it was computed for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdoperator.api.model import PDService
from pdoperator.api.status import (
    Condition,
    ConditionStatus,
    ConditionType,
    PDServiceStatus,
    Phase,
    RoleStatus,
)
from pdoperator.render.names import ComponentRole

AWAITING_ROUTER = "AwaitingRouter"

# Keys of .status the operator owns; anything else there (kopf's own bookkeeping) is left alone.
OWNED_STATUS_KEYS = (
    "phase",
    "observedGeneration",
    "prefill",
    "decode",
    "router",
    "routerEndpoint",
    "autoscaling",
    "conditions",
)


@dataclass(frozen=True)
class RoleRollout:
    """What one workload child (StatefulSet or Deployment) reports about its role."""

    role: ComponentRole
    desired: int
    ready: int
    reported: bool  # the workload controller has written status for the current generation
    rolled_out: bool  # every replica runs the current template

    @property
    def summary(self) -> str:
        return f"{self.ready}/{self.desired}"


def role_rollout(role: ComponentRole, desired: int, workload: dict[str, Any] | None) -> RoleRollout:
    """Read a StatefulSet's or Deployment's status; a missing workload has nothing ready and is not rolled
    out."""
    if workload is None:
        return RoleRollout(role, desired, 0, reported=False, rolled_out=desired == 0)
    status = workload.get("status") or {}
    generation = workload.get("metadata", {}).get("generation", 0)
    observed = status.get("observedGeneration")
    reported = observed is not None and observed >= generation
    # StatefulSets; both absent on Deployments
    revisions_match = status.get("currentRevision") == status.get("updateRevision")
    updated = status.get("updatedReplicas", 0)
    replicas = status.get("replicas", 0)
    rolled_out = reported and updated >= desired and replicas <= desired and revisions_match
    return RoleRollout(
        role, desired, int(status.get("readyReplicas", 0)), reported=reported, rolled_out=rolled_out
    )


def router_endpoint(pds: PDService, cluster_domain: str) -> str:
    return f"http://{pds.name}-router.{pds.namespace}.svc.{cluster_domain}:{pds.spec.router.port}"


class Conditions:
    """Builds a condition list; ``lastTransitionTime`` is carried over while a type keeps its status."""

    def __init__(self, previous: list[Condition], generation: int, now: str) -> None:
        self._previous = {c.type: c for c in previous}
        self._generation = generation
        self._now = now
        self.items: list[Condition] = []

    def set(self, type_: ConditionType, status: ConditionStatus, reason: str, message: str) -> None:
        before = self._previous.get(type_)
        keep = before is not None and before.status == status and before.last_transition_time
        since = before.last_transition_time if keep and before is not None else self._now
        self.items.append(
            Condition(
                type=type_,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=since,
                observed_generation=self._generation,
            )
        )

    def keep(self, condition: Condition) -> None:
        self.items.append(condition)


def parse_status(raw: dict[str, Any] | None) -> PDServiceStatus:
    """The status as stored; unreadable or foreign content counts as empty (it will be rewritten)."""
    try:
        return PDServiceStatus.model_validate(
            {k: v for k, v in (raw or {}).items() if k in OWNED_STATUS_KEYS}
        )
    except ValueError:
        return PDServiceStatus()


def dump_status(status: PDServiceStatus) -> dict[str, Any]:
    return status.model_dump(by_alias=True, exclude_none=True, mode="json")


def _role_text(rollouts: list[RoleRollout]) -> str:
    return ", ".join(f"{r.role.value} {r.summary}" for r in rollouts)


def healthy_status(
    pds: PDService,
    rollouts: list[RoleRollout],
    *,
    previous: PDServiceStatus,
    kv_condition: Condition | None,
    cluster_domain: str,
    now: str,
    unserved: Sequence[str] = (),
) -> PDServiceStatus:
    """Status of a valid PDService whose children have been applied.

    ``kv_condition`` is the latest KVTransferVerified verdict, or None to keep the stored one
    (the router is probed on its own schedule, not on every reconcile). ``unserved`` says, per kind of
    child this cluster does not serve (a CRD not installed), what to install: the service is degraded.
    """
    generation = pds.generation
    prior = previous.conditions
    not_rolled_out = [r for r in rollouts if not r.rolled_out]
    not_ready = [r for r in rollouts if r.ready < r.desired]
    stalled = [r for r in not_ready if r.rolled_out]  # rollout finished, replicas still missing
    kv = kv_condition or next((c for c in prior if c.type == ConditionType.KV_TRANSFER_VERIFIED), None)
    serving_without_transfer = kv is not None and kv.status == ConditionStatus.FALSE

    conditions = Conditions(prior, generation, now)
    conditions.set(ConditionType.SPEC_VALID, ConditionStatus.TRUE, "Valid", "spec passed validation")
    if not_ready or not_rolled_out:
        waiting = not_ready or not_rolled_out
        conditions.set(
            ConditionType.READY, ConditionStatus.FALSE, "ReplicasNotReady", f"ready: {_role_text(waiting)}"
        )
    else:
        conditions.set(
            ConditionType.READY, ConditionStatus.TRUE, "AllReplicasReady", f"ready: {_role_text(rollouts)}"
        )
    if not_rolled_out:
        message = "rolling out: " + ", ".join(r.role.value for r in not_rolled_out)
        conditions.set(ConditionType.PROGRESSING, ConditionStatus.TRUE, "RollingOut", message)
    else:
        conditions.set(
            ConditionType.PROGRESSING,
            ConditionStatus.FALSE,
            "RolloutComplete",
            "every role runs the current spec",
        )
    if unserved:
        conditions.set(
            ConditionType.DEGRADED, ConditionStatus.TRUE, "CustomResourceMissing", "; ".join(unserved)
        )
    elif stalled:
        message = f"rollout finished but replicas are not ready: {_role_text(stalled)}"
        conditions.set(ConditionType.DEGRADED, ConditionStatus.TRUE, "ReplicasUnavailable", message)
    elif serving_without_transfer:
        assert kv is not None
        conditions.set(ConditionType.DEGRADED, ConditionStatus.TRUE, kv.reason, kv.message)
    else:
        conditions.set(ConditionType.DEGRADED, ConditionStatus.FALSE, "AsExpected", "no role is impaired")
    if kv is None:  # not probed yet: the router is probed once it is ready
        conditions.set(
            ConditionType.KV_TRANSFER_VERIFIED,
            ConditionStatus.UNKNOWN,
            AWAITING_ROUTER,
            "the router is not ready to be asked yet",
        )
    else:
        conditions.keep(
            kv if kv_condition is not None else kv.model_copy(update={"observed_generation": generation})
        )

    phase = _phase(
        rollouts,
        degraded=bool(stalled or unserved) or serving_without_transfer,
        settled=not not_ready and not not_rolled_out,
    )
    by_role = {
        r.role: RoleStatus(desired_replicas=r.desired, ready_replicas=r.ready, summary=r.summary)
        for r in rollouts
    }
    return PDServiceStatus(
        phase=phase,
        observed_generation=generation,
        prefill=by_role.get(ComponentRole.PREFILL, RoleStatus()),
        decode=by_role.get(ComponentRole.DECODE, RoleStatus()),
        router=by_role.get(ComponentRole.ROUTER, RoleStatus()),
        router_endpoint=router_endpoint(pds, cluster_domain),
        conditions=conditions.items,
    )


def _phase(rollouts: list[RoleRollout], degraded: bool, settled: bool) -> Phase:
    if degraded:
        return Phase.DEGRADED
    if settled:
        return Phase.READY
    return Phase.PROGRESSING if any(r.reported for r in rollouts) else Phase.PENDING


def invalid_status(generation: int, previous: PDServiceStatus, message: str, now: str) -> PDServiceStatus:
    """An invalid spec changes nothing but SpecValid and the phase: the children keep serving the last valid
    spec."""
    conditions = Conditions(previous.conditions, generation, now)
    conditions.set(ConditionType.SPEC_VALID, ConditionStatus.FALSE, "InvalidSpec", message)
    for condition in previous.conditions:
        if condition.type != ConditionType.SPEC_VALID:
            conditions.keep(condition)
    return previous.model_copy(
        update={"phase": Phase.INVALID, "observed_generation": generation, "conditions": conditions.items}
    )


def status_patch(stored: dict[str, Any] | None, computed: PDServiceStatus) -> dict[str, Any] | None:
    """The merge patch of .status, or None when the stored status already says the same."""
    new = dump_status(computed)
    old = {k: v for k, v in (stored or {}).items() if k in OWNED_STATUS_KEYS}
    if old == new:
        return None
    return {"status": _replacing(old, new)}


def _replacing(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The merge patch that turns ``old`` into ``new`` (keys gone from ``new``, at any depth, nulled)."""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        patch[key] = (
            _replacing(before, value) if isinstance(value, dict) and isinstance(before, dict) else value
        )
    patch |= {key: None for key in old if key not in new}
    return patch
