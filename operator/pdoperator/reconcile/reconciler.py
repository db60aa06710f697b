"""One reconciliation of one PDService: parse, render, compare with the live children, write only what
differs, and write the status only when it changes. The kopf handlers are thin callers of this class.

Reconciliations of one PDService never overlap (a lock per object), and the bursts of child events
that follow every write collapse into a single follow-up reconciliation (``request``).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from pdconnector.protocol.params import EngineRole

from pdoperator.api import SpecError, parse_pdservice
from pdoperator.api.autoscaling import AutoscalingEngine
from pdoperator.api.model import PDService
from pdoperator.api.status import AutoscalingStatus, Condition, ConditionType, PDServiceStatus
from pdoperator.autoscale.policy import policy_of
from pdoperator.autoscale.rounds import History, Readings, autoscale_round
from pdoperator.autoscale.scale import Scale, bounded
from pdoperator.render import ComponentRole, RenderDefaults, child_name
from pdoperator.render.identity import role_spec
from pdoperator.render.names import pod_name

from .children import Action, Create, Patch, children_selector, describe, desired_children, plan
from .kinds import CHILD_KINDS, DEPLOYMENTS, LEADERWORKERSETS, PDSERVICES, STATEFULSETS, ResourceKind, kind_of
from .kube import KubeApi, KubeApiError
from .kvtransfer import (
    UNREACHABLE,
    RouterStatusError,
    TransferCounts,
    Verdict,
    as_condition,
    unreachable_verdict,
    verdict,
)
from .scaling import (
    CONFIG_PROPAGATION_S,
    autoscaling_status,
    drain_expired,
    effective_scale,
    live_statefulset_replicas,
    scaled,
    stored_scale,
)
from .status import AWAITING_ROUTER, healthy_status, invalid_status, parse_status, role_rollout, status_patch

logger = logging.getLogger(__name__)

Key = tuple[str, str]


class Trigger(StrEnum):
    SPEC = "spec"  # the PDService was created, changed, or the operator (re)started
    CHILD = "child"  # a child changed, was deleted, or reported new status
    AUTOSCALE = "autoscale"  # the autoscaler decided a new scale


# Reads one round of the router's and the engines' /metrics for the autoscaler.
MetricsReader = Callable[[PDService, Scale], Coroutine[Any, Any, Readings]]


class EventRecorder(Protocol):
    def __call__(self, body: dict[str, Any], type_: str, reason: str, message: str) -> None: ...


class InvalidSpecError(Exception):
    """The PDService's spec was rejected; its status says why. Retrying cannot help until the spec changes."""


@dataclass
class ReconcileOutcome:
    """What one reconcile pass wrote: the child actions it applied and whether it wrote the status."""

    actions: list[Action] = field(default_factory=list)
    status_written: bool = False

    @property
    def writes(self) -> int:
        return len(self.actions) + int(self.status_written)


def utc_now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _KVState:
    counts: TransferCounts | None = None  # the router's counters at the last successful probe
    traffic: Verdict | None = None  # the last verdict on those counters
    shown: Verdict | None = None  # what the condition says (also "router unreachable")


class Reconciler:
    def __init__(
        self,
        api: KubeApi,
        record_event: EventRecorder,
        defaults: RenderDefaults,
        clock: Callable[[], str] = utc_now,
    ) -> None:
        self._api = api
        self._record_event = record_event
        self._defaults = defaults
        self._clock = clock
        self._locks: dict[Key, asyncio.Lock] = {}
        self._pending: set[Key] = set()
        self._kv: dict[Key, _KVState] = {}
        self._history: dict[Key, History] = {}  # the autoscaler's samples
        self._decided: dict[Key, tuple[Scale, str]] = {}  # a new scale for the next reconcile to apply
        # resourceVersion of each child as the operator last wrote it: the watch echoes every write back.
        self._written: dict[tuple[str, str, str], str] = {}

    def _lock(self, key: Key) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    # ---- entry points

    async def reconcile(self, body: dict[str, Any]) -> ReconcileOutcome:
        """Bring children and status to the spec (create/update/resume). Raises InvalidSpecError for a
        rejected spec."""
        async with self._lock(_key(body)):
            return await self._reconcile(body, Trigger.SPEC)

    def is_own_write(self, plural: str, namespace: str, name: str, resource_version: str | None) -> bool:
        """Whether a child event only echoes the operator's own last write (nothing to reconcile)."""
        return (
            resource_version is not None and self._written.get((plural, namespace, name)) == resource_version
        )

    async def request(self, namespace: str, name: str) -> ReconcileOutcome | None:
        """Reconcile after a child changed; calls arriving while one waits for the lock are absorbed by it."""
        key = (namespace, name)
        if key in self._pending:
            return None
        self._pending.add(key)
        async with self._lock(key):
            self._pending.discard(key)
            body = await self._api.get(PDSERVICES, namespace, name)
            if body is None or body.get("metadata", {}).get("deletionTimestamp"):
                return None  # gone or going: children must not come back
            try:
                return await self._reconcile(body, Trigger.CHILD)
            except InvalidSpecError:
                return None  # reported when the spec was written; children stay as they are

    async def delete_children(self, body: dict[str, Any]) -> list[str]:
        """Delete every child this PDService controls (garbage collection would too; this does not wait for
        it)."""
        key = _key(body)
        async with self._lock(key):
            uid = body["metadata"].get("uid", "")
            live, _ = await self._read_children(key[0], key[1])
            actions = plan([], live, uid)
            await self._apply(actions, key[0])
            self._kv.pop(key, None)
            self._history.pop(key, None)
            self._decided.pop(key, None)
        self._locks.pop(key, None)
        for action in actions:
            self._written.pop((action.kind.plural, key[0], action.name), None)
        names = [describe(a) for a in actions]
        if names:
            self._record_event(body, "Normal", "ChildrenDeleted", "; ".join(names))
        return names

    async def probe_kv_transfer(
        self, body: dict[str, Any], fetch: Callable[[PDService], Coroutine[Any, Any, TransferCounts]]
    ) -> bool:
        """Ask the router whether requests are served with transferred KV; True when the condition changed."""
        try:
            pds = parse_pdservice(body)
        except SpecError:
            return False
        stored_status = parse_status(body.get("status"))
        if stored_status.router.ready_replicas == 0:
            return False  # nothing to ask yet (or no router at all)
        key = (pds.namespace, pds.name)
        state = self._kv.setdefault(key, _KVState())
        stored = next(
            (c for c in stored_status.conditions if c.type == ConditionType.KV_TRANSFER_VERIFIED), None
        )
        if stored is not None and stored.reason == AWAITING_ROUTER:
            stored = None  # a placeholder, not a verdict
        try:
            counts = await fetch(pds)
        except RouterStatusError as e:
            if stored is not None or state.shown is not None:
                return False  # a router restart or a network blip does not erase what was verified
            new = unreachable_verdict(e)
        else:
            if state.counts is None and stored is not None and stored.reason != UNREACHABLE:
                # First probe since the operator started: the stored verdict stands, these counts are the
                # baseline.
                state.traffic = Verdict(stored.status, stored.reason, stored.message)
                state.counts = counts
            new = verdict(counts, state.counts, state.traffic)
            state.counts, state.traffic = counts, new
        changed = stored is None or (stored.status, stored.reason, stored.message) != (
            new.status,
            new.reason,
            new.message,
        )
        state.shown = new
        if changed:
            if new.reason == "ServedWithoutTransfer":
                self._record_event(body, "Warning", "ServedWithoutTransfer", new.message)
            await self.request(pds.namespace, pds.name)
        return changed

    async def autoscale(self, body: dict[str, Any], read: MetricsReader) -> bool:
        """One autoscaler round (spec.autoscaling.engine builtin): read the metrics, plan, and when the scale
        changes reconcile the children to it; True when it changed."""
        try:
            pds = parse_pdservice(body)
        except SpecError:
            return False
        scaling = pds.spec.autoscaling
        stored = parse_status(body.get("status")).autoscaling
        if scaling is None or scaling.engine is not AutoscalingEngine.BUILTIN or stored is None:
            return False  # not ours to size, or not reconciled yet (that writes where the roles start)
        key = (pds.namespace, pds.name)
        policy = policy_of(scaling)
        current = bounded(policy, stored_scale(stored))
        readings = await read(pds, current)
        decided = autoscale_round(
            policy,
            scaling.targets.percentile,
            self._history.get(key, History()),
            current,
            readings,
            pod_name=lambda role, ordinal: pod_name(pds, ComponentRole(role.value), ordinal),
            drain_expired=drain_expired(stored, scaling.drain_timeout_seconds, self._clock()),
            # the operator reads one router through its Service; others follow the ConfigMap within this bound
            routers_reloaded=pds.spec.router.replicas <= 1
            or drain_expired(stored, CONFIG_PROPAGATION_S, self._clock()),
        )
        self._history[key] = decided.history
        if decided.scale == current:
            return False
        self._decided[key] = (decided.scale, decided.reason)
        await self.request(pds.namespace, pds.name)
        return True

    # ---- the reconciliation

    def _scale(
        self, pds: PDService, previous: PDServiceStatus, live: dict[ResourceKind, list[dict[str, Any]]]
    ) -> tuple[PDService, AutoscalingStatus | None, bool]:
        """The PDService as its children are rendered under spec.autoscaling, the status of that scale, and
        whether it is a new decision of the autoscaler's."""
        key = (pds.namespace, pds.name)
        decided = self._decided.pop(key, None)
        fresh = decided is not None and pds.spec.autoscaling is not None
        if not fresh:
            live_replicas = {
                role: live_statefulset_replicas(
                    _find(live, STATEFULSETS, child_name(pds, ComponentRole(role)))
                )
                for role in EngineRole
            }
            decided = effective_scale(pds, previous.autoscaling, live_replicas)
        if decided is None:
            return pds, None, False
        scale, reason = decided
        status = autoscaling_status(scale, reason, previous.autoscaling, self._clock())
        return scaled(pds, scale), status, fresh

    async def _reconcile(self, body: dict[str, Any], trigger: Trigger) -> ReconcileOutcome:
        meta = body["metadata"]
        previous = parse_status(body.get("status"))
        try:
            pds = parse_pdservice(body)
        except SpecError as e:
            message = "; ".join(str(error) for error in e.errors)
            written = await self._write_status(
                body, invalid_status(meta.get("generation", 1), previous, message, self._clock())
            )
            if written and trigger is Trigger.SPEC:  # once per rejected generation, not again on restarts
                self._record_event(body, "Warning", "InvalidSpec", message)
            raise InvalidSpecError(message) from e

        live, absent = await self._read_children(pds.namespace, pds.name)
        had_children = any(live.values())
        pds, autoscaling, autoscaled = self._scale(pds, previous, live)
        desired = desired_children(pds, self._defaults)
        # Kinds this cluster does not serve: the rest is applied, the status says what to install.
        unserved = sorted({kind_of(child) for child in desired} & absent, key=lambda kind: kind.kind)
        actions = plan([child for child in desired if kind_of(child) not in absent], live, pds.uid)
        applied = await self._apply(actions, pds.namespace)
        for action, obj in zip(actions, applied, strict=True):
            kind, name = action.kind, action.name
            live[kind] = [o for o in live[kind] if o["metadata"]["name"] != name] + ([obj] if obj else [])
            if obj and (version := obj["metadata"].get("resourceVersion")):
                self._written[(kind.plural, pds.namespace, name)] = version
        if autoscaled:
            trigger = Trigger.AUTOSCALE
        if actions:
            self._record_event(
                body, "Normal", _reason(trigger, had_children), "; ".join(describe(a) for a in actions)
            )

        kv = self._kv_condition((pds.namespace, pds.name), previous, pds.generation)
        rollouts = [
            *(
                role_rollout(
                    role,
                    role_spec(pds.spec, role).replicas,
                    _find(live, engine_workload_kind(pds, role), child_name(pds, role)),
                )
                for role in (ComponentRole.PREFILL, ComponentRole.DECODE)
            ),
            role_rollout(
                ComponentRole.ROUTER,
                pds.spec.router.replicas,
                _find(live, DEPLOYMENTS, child_name(pds, ComponentRole.ROUTER)),
            ),
        ]
        status = healthy_status(
            pds,
            rollouts,
            previous=previous,
            kv_condition=kv,
            cluster_domain=self._defaults.cluster_domain,
            now=self._clock(),
            unserved=[kind.absent_message() for kind in unserved],
        ).model_copy(update={"autoscaling": autoscaling})
        written = await self._write_status(body, status)
        if unserved:  # retried: the CRD may be installed later, and nothing else would bring a reconcile
            raise KubeApiError(404, "NotFound", "; ".join(kind.absent_message() for kind in unserved))
        return ReconcileOutcome(actions=actions, status_written=written)

    def _kv_condition(self, key: Key, previous: Any, generation: int) -> Condition | None:
        state = self._kv.get(key)
        if state is None or state.shown is None:
            return None
        stored = next((c for c in previous.conditions if c.type == ConditionType.KV_TRANSFER_VERIFIED), None)
        return as_condition(state.shown, stored, generation, self._clock())

    async def _read_children(
        self, namespace: str, name: str
    ) -> tuple[dict[ResourceKind, list[dict[str, Any]]], frozenset[ResourceKind]]:
        """The live children by kind, and the optional kinds this cluster does not serve."""
        selector = children_selector(name)
        lists = await asyncio.gather(*(self._list(kind, namespace, selector) for kind in CHILD_KINDS))
        live = {kind: objects or [] for kind, objects in zip(CHILD_KINDS, lists, strict=True)}
        absent = frozenset(kind for kind, objects in zip(CHILD_KINDS, lists, strict=True) if objects is None)
        return live, absent

    async def _list(self, kind: ResourceKind, namespace: str, selector: str) -> list[dict[str, Any]] | None:
        """The objects of ``kind``; None where its CRD is not installed (nothing of that kind exists)."""
        try:
            return await self._api.list(kind, namespace, selector)
        except KubeApiError as e:
            if e.status == 404 and kind.optional:
                return None
            raise

    async def _apply(self, actions: list[Action], namespace: str) -> list[dict[str, Any]]:
        """Run the plan; returns, per action, the object as the server answered (empty for a deletion).

        The writes touch distinct objects and Kubernetes tolerates any order (a StatefulSet may
        exist before its Service), so they run concurrently: a first rollout costs one round trip,
        not one per child.
        """
        return list(await asyncio.gather(*(self._run(action, namespace) for action in actions)))

    async def _run(self, action: Action, namespace: str) -> dict[str, Any]:
        if isinstance(action, Create):
            return await self._create(action.kind, namespace, action.body)
        if isinstance(action, Patch):
            return await self._patch(action, namespace)
        await self._api.delete(action.kind, namespace, action.name)
        return {}

    async def _create(self, kind: ResourceKind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self._api.create(kind, namespace, body)
        except KubeApiError as e:
            if e.status == 409:  # created meanwhile (a stale read): its ADDED event brings the next reconcile
                return {"metadata": {"name": body["metadata"]["name"]}}
            if e.status == 404 and kind.optional:  # its CRD went away since the children were read
                raise KubeApiError(404, "NotFound", kind.absent_message()) from e
            raise

    async def _patch(self, action: Patch, namespace: str) -> dict[str, Any]:
        try:
            return await self._api.patch(action.kind, namespace, action.name, action.patch)
        except KubeApiError as e:
            if e.status == 404:  # deleted meanwhile
                return await self._create(action.kind, namespace, action.desired)
            if (
                e.status == 422
            ):  # an immutable field changed (e.g. a StatefulSet's volumeClaimTemplates): replace the child
                logger.warning("replacing %s %s/%s: %s", action.kind.kind, namespace, action.name, e.message)
                await self._api.delete(action.kind, namespace, action.name)
                return {"metadata": {"name": action.name}}
            raise

    async def _write_status(self, body: dict[str, Any], status: Any) -> bool:
        patch = status_patch(body.get("status"), status)
        if patch is None:
            return False
        meta = body["metadata"]
        try:
            await self._api.patch(PDSERVICES, meta["namespace"], meta["name"], patch, subresource="status")
        except KubeApiError as e:
            if e.status == 404:
                return False
            raise
        return True


def engine_workload_kind(pds: PDService, role: ComponentRole) -> ResourceKind:
    """The kind of a role's engine workload (``pdoperator.render.pdservice.render_engine_workload``)."""
    return LEADERWORKERSETS if role_spec(pds.spec, role).spans_nodes else STATEFULSETS


def _key(body: dict[str, Any]) -> Key:
    return body["metadata"]["namespace"], body["metadata"]["name"]


def _find(
    live: dict[ResourceKind, list[dict[str, Any]]], kind: ResourceKind, name: str
) -> dict[str, Any] | None:
    return next(
        (o for o in live.get(kind, []) if o.get("metadata", {}).get("name") == name and "spec" in o), None
    )


def _reason(trigger: Trigger, had_children: bool) -> str:
    if trigger is Trigger.CHILD:
        return "DriftCorrected"
    if trigger is Trigger.AUTOSCALE:
        return "Autoscaled"
    return "RolloutStarted" if had_children else "ChildrenCreated"
