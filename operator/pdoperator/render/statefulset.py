"""The engine StatefulSets: stable pod names give stable DNS names and engine ids."""

from __future__ import annotations

from typing import Any

from pdoperator.api.model import PDService

from .defaults import RenderDefaults
from .engine import render_engine_pod_template
from .identity import role_spec
from .names import ComponentRole, child_name, object_meta, selector_labels


def render_engine_statefulset(
    pds: PDService, role: ComponentRole, defaults: RenderDefaults
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": object_meta(pds, role),
        "spec": {
            "serviceName": child_name(pds, role),
            "replicas": role_spec(pds.spec, role).replicas,
            # Engines are independent peers: start and replace them all at once.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector_labels(pds, role)},
            "template": render_engine_pod_template(pds, role, defaults),
        },
    }
