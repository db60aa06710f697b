"""The replica counts a PDService's children get when ``spec.autoscaling`` owns them (pure).

builtin: the scale the autoscaler last decided, as stored in ``status.autoscaling`` (so an operator restart
keeps it), or where the roles start; the children are rendered with those counts and the router config marks
the draining engines. hpa / keda: the counts the scalers set on the StatefulSets, read back from them, so
the router lists every engine they run and the operator never writes the replicas back.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from pdconnector.protocol.params import EngineRole

from pdoperator.api.autoscaling import AutoscalingEngine
from pdoperator.api.model import PDService
from pdoperator.api.status import AutoscalingStatus, RoleScaleStatus
from pdoperator.autoscale.planner import Replicas
from pdoperator.autoscale.policy import policy_of
from pdoperator.autoscale.scale import RoleScale, Scale, bounded, initial_scale, steady


def stored_scale(status: AutoscalingStatus) -> Scale:
    return Scale(
        RoleScale(status.prefill.replicas, min(status.prefill.serving, status.prefill.replicas)),
        RoleScale(status.decode.replicas, min(status.decode.serving, status.decode.replicas)),
    )


def effective_scale(
    pds: PDService,
    stored: AutoscalingStatus | None,
    live_replicas: Mapping[EngineRole, int | None],
) -> tuple[Scale, str] | None:
    """The scale to render and why; None without ``spec.autoscaling``."""
    scaling = pds.spec.autoscaling
    if scaling is None:
        return None
    policy = policy_of(scaling)
    requested = Replicas(pds.spec.prefill.replicas, pds.spec.decode.replicas)
    if scaling.engine is AutoscalingEngine.BUILTIN:
        if stored is not None and stored.reason:
            kept = stored_scale(stored)
            scale = bounded(policy, kept)
            if scale == kept:
                return scale, stored.reason
            return (
                scale,
                f"spec.autoscaling changed: prefill {scale.prefill.serving}, decode {scale.decode.serving}",
            )
        start = initial_scale(policy, requested)
        return start, f"starting at prefill {start.prefill.replicas}, decode {start.decode.replicas}"
    # The scalers own the counts; before they exist, the roles start at their minimum.
    counts = {
        role: min(
            max(live if live is not None else bounds.min_replicas, bounds.min_replicas), bounds.max_replicas
        )
        for role, bounds, live in (
            (EngineRole.PREFILL, policy.prefill, live_replicas.get(EngineRole.PREFILL)),
            (EngineRole.DECODE, policy.decode, live_replicas.get(EngineRole.DECODE)),
        )
    }
    kind = "HorizontalPodAutoscaler" if scaling.engine is AutoscalingEngine.HPA else "KEDA ScaledObject"
    return steady(
        Replicas(counts[EngineRole.PREFILL], counts[EngineRole.DECODE])
    ), f"sized by a {kind} per role"


def scaled(pds: PDService, scale: Scale) -> PDService:
    """The PDService as rendered under ``scale``: the roles' replicas, and the engines the router serves."""
    spec = pds.spec.model_copy(
        update={
            "prefill": pds.spec.prefill.model_copy(update={"replicas": scale.prefill.replicas}),
            "decode": pds.spec.decode.model_copy(update={"replicas": scale.decode.replicas}),
        }
    )
    serving = {"prefill": scale.prefill.serving, "decode": scale.decode.serving}
    return pds.model_copy(update={"spec": spec, "serving": serving})


def autoscaling_status(
    scale: Scale, reason: str, previous: AutoscalingStatus | None, now: str
) -> AutoscalingStatus:
    """The status of ``scale``: the time of the last change and of the drain's start carried over while they
    still hold."""
    unchanged = previous is not None and stored_scale(previous) == scale
    was_draining = previous is not None and previous.draining_since is not None
    return AutoscalingStatus(
        prefill=RoleScaleStatus(replicas=scale.prefill.replicas, serving=scale.prefill.serving),
        decode=RoleScaleStatus(replicas=scale.decode.replicas, serving=scale.decode.serving),
        reason=previous.reason if unchanged and previous is not None else reason,
        last_scale_time=previous.last_scale_time if unchanged and previous is not None else now,
        draining_since=(
            (previous.draining_since if was_draining and previous is not None else now)
            if scale.draining
            else None
        ),
    )


# How long a ConfigMap change may take to reach a pod's mounted file: the kubelet's sync period plus its cache
# TTL (a minute each by default), plus the router's own 2 s reload interval.
CONFIG_PROPAGATION_S = 125


def drain_expired(status: AutoscalingStatus | None, timeout_s: int, now: str) -> bool:
    """Whether the drain in ``status`` began more than ``timeout_s`` before ``now`` (RFC 3339 times)."""
    if status is None or status.draining_since is None:
        return False
    try:
        began = _parse_time(status.draining_since)
    except ValueError:
        return True  # an unreadable start cannot hold engines forever
    return (_parse_time(now) - began).total_seconds() >= timeout_s


def live_statefulset_replicas(statefulset: dict[str, Any] | None) -> int | None:
    replicas = ((statefulset or {}).get("spec") or {}).get("replicas")
    return replicas if isinstance(replicas, int) else None


def _parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
