"""Per-role scaler objects for ``spec.autoscaling.engine`` hpa or keda: a HorizontalPodAutoscaler or a KEDA
ScaledObject per engine StatefulSet, on the same targets the builtin planner reads.

What they lose against builtin: each role scales alone (no prefill:decode ratio), and an engine leaves when
its pod is deleted, without first leaving the router's pool (the router drops it once it stops being ready;
requests still on it run until the pod's termination grace period ends).

- hpa: Pods metrics, averaged per engine, served by a custom-metrics adapter (e.g. prometheus-adapter)
  under the names in ``HPA_METRIC_NAMES``: vLLM's names with ``:`` replaced by ``_``.
- keda: Prometheus triggers. Queue targets are per engine (``AverageValue``); latency targets are the
  service's percentile over the last minute (``Value``: replicas grow by the ratio of latency to target).
  Series are matched by the ``namespace`` and ``pod`` labels that Prometheus' Kubernetes pod discovery and
  PodMonitors give them.
"""

from __future__ import annotations

from typing import Any

from pdoperator.api.autoscaling import AutoscalingEngine, AutoscalingSpec, ReplicaRange
from pdoperator.api.model import PDService
from pdoperator.autoscale.signals import ENGINE_RUNNING, ENGINE_TPOT, ENGINE_WAITING, ROUTER_TTFT

from .names import ComponentRole, child_name, object_meta

HPA_METRIC_NAMES = {name: name.replace(":", "_") for name in (ENGINE_WAITING, ENGINE_RUNNING)}
LATENCY_RATE_WINDOW = "1m"
_HPA_MAX_PERIOD_S = 1800  # autoscaling/v2 HPAScalingPolicy.periodSeconds


def render_scalers(pds: PDService) -> list[dict[str, Any]]:
    """One scaler per engine role when spec.autoscaling asks for HPA or KEDA objects; none otherwise."""
    scaling = pds.spec.autoscaling
    if scaling is None or scaling.engine is AutoscalingEngine.BUILTIN:
        return []
    render = _horizontal_pod_autoscaler if scaling.engine is AutoscalingEngine.HPA else _scaled_object
    return [render(pds, scaling, role) for role in (ComponentRole.PREFILL, ComponentRole.DECODE)]


def _bounds(scaling: AutoscalingSpec, role: ComponentRole) -> ReplicaRange:
    return scaling.prefill if role is ComponentRole.PREFILL else scaling.decode


def _target(pds: PDService, role: ComponentRole) -> dict[str, str]:
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": child_name(pds, role)}


def _behavior(scaling: AutoscalingSpec) -> dict[str, Any]:
    """The builtin planner's windows, and its halving: a scale-down keeps half a role's engines per window (an
    HPA's policy period lies in 1..1800 s)."""
    window = scaling.scale_down_window_seconds
    halving = {"type": "Percent", "value": 50, "periodSeconds": min(max(window, 1), _HPA_MAX_PERIOD_S)}
    return {
        "scaleUp": {"stabilizationWindowSeconds": scaling.scale_up_window_seconds},
        "scaleDown": {"stabilizationWindowSeconds": window, "policies": [halving]},
    }


def _queue_target(scaling: AutoscalingSpec, role: ComponentRole) -> tuple[str, int | None]:
    """The per-engine queue metric of ``role`` and its target (None when the spec sets none)."""
    if role is ComponentRole.PREFILL:
        return ENGINE_WAITING, scaling.targets.waiting_requests_per_prefill
    return ENGINE_RUNNING, scaling.targets.running_requests_per_decode


def _horizontal_pod_autoscaler(
    pds: PDService, scaling: AutoscalingSpec, role: ComponentRole
) -> dict[str, Any]:
    metric, target = _queue_target(scaling, role)
    bounds = _bounds(scaling, role)
    # validation holds that an hpa role has its queue target, and no latency target, and minReplicas >= 1
    assert target is not None
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": object_meta(pds, role),
        "spec": {
            "scaleTargetRef": _target(pds, role),
            "minReplicas": bounds.min_replicas,
            "maxReplicas": bounds.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": HPA_METRIC_NAMES[metric]},
                        "target": {"type": "AverageValue", "averageValue": str(target)},
                    },
                }
            ],
            "behavior": _behavior(scaling),
        },
    }


def _pods(pds: PDService, role: ComponentRole) -> str:
    """A PromQL label matcher of one role's pods: StatefulSet pods are ``<name>-<ordinal>``, the router
    Deployment's ``<name>-<replicaset hash>-<suffix>``."""
    pattern = "[0-9]+" if role is not ComponentRole.ROUTER else "[a-z0-9]+-[a-z0-9]+"
    return f'namespace="{pds.namespace}",pod=~"{child_name(pds, role)}-{pattern}"'


def _latency_query(pds: PDService, percentile: int, histogram: str, measured_on: ComponentRole) -> str:
    return (
        f"histogram_quantile({percentile / 100:g}, sum by (le) "
        f"(rate({histogram}_bucket{{{_pods(pds, measured_on)}}}[{LATENCY_RATE_WINDOW}])))"
    )


def _trigger(name: str, server: str, query: str, threshold: float, metric_type: str) -> dict[str, Any]:
    return {
        "type": "prometheus",
        "name": name,
        "metricType": metric_type,
        "metadata": {"serverAddress": server, "query": query, "threshold": f"{threshold:g}"},
    }


def _scaled_object(pds: PDService, scaling: AutoscalingSpec, role: ComponentRole) -> dict[str, Any]:
    # validation holds that keda comes with spec.autoscaling.prometheus
    assert scaling.prometheus is not None
    server = scaling.prometheus.server_address
    targets = scaling.targets
    queue_metric, queue_target = _queue_target(scaling, role)
    latency = (
        ("ttft", ROUTER_TTFT, ComponentRole.ROUTER, targets.ttft_milliseconds)
        if role is ComponentRole.PREFILL
        else ("tpot", ENGINE_TPOT, ComponentRole.DECODE, targets.tpot_milliseconds)
    )
    triggers = []
    name, histogram, measured_on, milliseconds = latency
    if milliseconds is not None:
        query = _latency_query(pds, targets.percentile, histogram, measured_on)
        triggers.append(_trigger(name, server, query, milliseconds / 1000, "Value"))
    if queue_target is not None:
        query = f"sum({queue_metric}{{{_pods(pds, role)}}})"
        triggers.append(_trigger(HPA_METRIC_NAMES[queue_metric], server, query, queue_target, "AverageValue"))
    bounds = _bounds(scaling, role)
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": object_meta(pds, role),
        "spec": {
            "scaleTargetRef": _target(pds, role),
            "minReplicaCount": bounds.min_replicas,
            "maxReplicaCount": bounds.max_replicas,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(scaling)}},
            "triggers": triggers,
        },
    }
