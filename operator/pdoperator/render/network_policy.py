"""NetworkPolicies: engines talk only to each other and the router; the router's port is open."""

from __future__ import annotations

from typing import Any

from pdoperator.api.autoscaling import AutoscalingEngine
from pdoperator.api.model import PDService

from .cache_routing import kv_events_container_ports
from .defaults import RenderDefaults
from .monitoring import scraper_peers
from .names import (
    ENGINE_ROLES,
    LABEL_ROLE,
    ROUTER_HTTP_PORT,
    ComponentRole,
    child_name,
    instance_labels,
    managed_labels,
    object_labels,
    selector_labels,
)


def _engine_pods(pds: PDService) -> dict[str, Any]:
    return {
        "matchLabels": instance_labels(pds),
        "matchExpressions": [
            {"key": LABEL_ROLE, "operator": "In", "values": [role.value for role in ENGINE_ROLES]}
        ],
    }


def _policy(
    pds: PDService,
    name: str,
    labels: dict[str, str],
    pod_selector: dict[str, Any],
    ingress: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": pds.namespace, "labels": labels},
        "spec": {"podSelector": pod_selector, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _operator_peer(pds: PDService, defaults: RenderDefaults) -> dict[str, Any] | None:
    """The operator's pods, when its builtin autoscaler reads the engines' /metrics and the installation says
    where they run."""
    scaling = pds.spec.autoscaling
    labels = defaults.operator_pods()
    if scaling is None or scaling.engine is not AutoscalingEngine.BUILTIN or labels is None:
        return None
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": defaults.operator_namespace}},
        "podSelector": {"matchLabels": labels},
    }


def render_engine_network_policy(pds: PDService, defaults: RenderDefaults) -> dict[str, Any]:
    """Ingress of the engine pods.

    From this PDService's other engines every port is open: besides HTTP and the side
    channel, NIXL's UCX and TCP transports connect on ports they pick at run time (EFA
    RDMA bypasses the kernel and is not subject to NetworkPolicies). From the router, the
    spec's metrics scrapers and, under the builtin autoscaler, the operator only the engines'
    HTTP port, and for the router, under the cache-aware policy, the KV cache events and replay ports.
    Other traffic needs a policy of its own.
    """
    http_only = [{"protocol": "TCP", "port": pds.spec.engine.port}]
    kv_events = [{"protocol": "TCP", "port": p["containerPort"]} for p in kv_events_container_ports(pds.spec)]
    ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": _engine_pods(pds)}]},
        {
            "from": [{"podSelector": {"matchLabels": selector_labels(pds, ComponentRole.ROUTER)}}],
            "ports": http_only + kv_events,
        },
    ]
    if scrapers := scraper_peers(pds):
        ingress.append({"from": scrapers, "ports": http_only})
    if operator := _operator_peer(pds, defaults):
        ingress.append({"from": [operator], "ports": http_only})
    return _policy(pds, f"{pds.name}-engines", managed_labels(pds, "engines"), _engine_pods(pds), ingress)


def render_router_network_policy(pds: PDService) -> dict[str, Any]:
    """Ingress of the router pods: the OpenAI port from anywhere, so it works under a namespace's
    default-deny."""
    return _policy(
        pds,
        child_name(pds, ComponentRole.ROUTER),
        object_labels(pds, ComponentRole.ROUTER),
        {"matchLabels": selector_labels(pds, ComponentRole.ROUTER)},
        [{"ports": [{"protocol": "TCP", "port": ROUTER_HTTP_PORT}]}],
    )


def render_network_policies(pds: PDService, defaults: RenderDefaults) -> list[dict[str, Any]]:
    return [render_engine_network_policy(pds, defaults), render_router_network_policy(pds)]
