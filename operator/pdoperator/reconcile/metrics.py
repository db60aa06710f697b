"""Prometheus metrics of the reconciler (served with ``pd-operator --metrics-port``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram

if TYPE_CHECKING:
    from .reconciler import ReconcileOutcome

RECONCILES = Counter("pd_operator_reconciles_total", "Reconciliations of PDServices.", ["trigger", "result"])
CHILD_WRITES = Counter(
    "pd_operator_child_writes_total", "Writes to children (create, update, delete).", ["kind", "action"]
)
STATUS_WRITES = Counter("pd_operator_status_writes_total", "Writes of PDService status.")
RECONCILE_SECONDS = Histogram("pd_operator_reconcile_seconds", "Duration of one reconciliation.", ["trigger"])


def observe(trigger: str, outcome: ReconcileOutcome, seconds: float) -> None:
    RECONCILES.labels(trigger=trigger, result="ok").inc()
    RECONCILE_SECONDS.labels(trigger=trigger).observe(seconds)
    for action in outcome.actions:
        CHILD_WRITES.labels(kind=action.kind.kind, action=type(action).__name__.lower()).inc()
    if outcome.status_written:
        STATUS_WRITES.inc()
