"""From ``spec.autoscaling`` to the planner's :class:`~pdoperator.autoscale.planner.Policy` (pure)."""

from __future__ import annotations

from pdoperator.api.autoscaling import AutoscalingSpec

from .planner import Policy, RoleBounds, Targets


def policy_of(scaling: AutoscalingSpec) -> Policy:
    """The planner's policy; raises ``ValueError`` when the bounds and the ratio range admit no replica pair
    (or a role has no target: the CRD's rules reject that first)."""
    targets = scaling.targets
    ratio = scaling.prefill_per_decode
    return Policy(
        prefill=RoleBounds(scaling.prefill.min_replicas, scaling.prefill.max_replicas),
        decode=RoleBounds(scaling.decode.min_replicas, scaling.decode.max_replicas),
        targets=Targets(
            ttft_s=_seconds(targets.ttft_milliseconds),
            waiting_per_prefill=targets.waiting_requests_per_prefill,
            tpot_s=_seconds(targets.tpot_milliseconds),
            running_per_decode=targets.running_requests_per_decode,
        ),
        # unset: any ratio (every prefill count over at least one decode engine)
        ratio_min=ratio.min_percent / 100 if ratio else 0.0,
        ratio_max=ratio.max_percent / 100 if ratio else float(scaling.prefill.max_replicas),
        scale_up_window_s=float(scaling.scale_up_window_seconds),
        scale_down_window_s=float(scaling.scale_down_window_seconds),
        tolerance=scaling.tolerance_percent / 100,
    )


def _seconds(milliseconds: int | None) -> float | None:
    return None if milliseconds is None else milliseconds / 1000
