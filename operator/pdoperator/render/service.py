"""Services: a headless one per engine role (stable pod DNS names), a ClusterIP one for the router."""

from __future__ import annotations

from typing import Any

from pdoperator.api.model import PDService

from .identity import role_spec
from .names import ComponentRole, object_meta, selector_labels


def render_headless_service(pds: PDService, role: ComponentRole) -> dict[str, Any]:
    """Governing Service of an engine StatefulSet: DNS records of ready pods only. Of a LeaderWorkerSet
    (which takes a Service of its own name as given): of every pod, as the workers of a group must reach its
    leader before it can be ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(pds, role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": role_spec(pds.spec, role).spans_nodes,
            "selector": selector_labels(pds, role),
            "ports": [
                {"name": "http", "port": pds.spec.engine.port, "targetPort": "http", "protocol": "TCP"},
                {
                    "name": "side-channel",
                    "port": pds.spec.engine.side_channel_port,
                    "targetPort": "side-channel",
                    "protocol": "TCP",
                },
            ],
        },
    }


def render_router_service(pds: PDService) -> dict[str, Any]:
    """The in-cluster OpenAI endpoint of the PDService."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(pds, ComponentRole.ROUTER),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(pds, ComponentRole.ROUTER),
            "ports": [
                {"name": "http", "port": pds.spec.router.port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }
