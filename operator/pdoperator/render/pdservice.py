"""All manifests of one PDService, in apply order."""

from __future__ import annotations

from typing import Any

from pdoperator.api.model import PDService

from .defaults import RenderDefaults
from .disruption_budget import render_pod_disruption_budgets
from .names import ComponentRole
from .network_policy import render_network_policies
from .router import render_router_configmap, render_router_deployment
from .scalers import render_scalers
from .service import render_headless_service, render_router_service
from .statefulset import render_decode_statefulset, render_prefill_statefulset


def render_pdservice(pds: PDService, defaults: RenderDefaults) -> list[dict[str, Any]]:
    """The children of a validated PDService (without owner references), in the order to apply them.

    Pure and deterministic: equal inputs give equal, freshly built objects. The order
    follows Helm's install order (policies, config, services, then workloads), so the
    engines' governing Services exist before their StatefulSets and the router's
    config before the router; the scalers follow the workloads they scale.
    """
    return [
        *render_network_policies(pds, defaults),
        *render_pod_disruption_budgets(pds),
        render_router_configmap(pds, defaults),
        render_headless_service(pds, ComponentRole.PREFILL),
        render_headless_service(pds, ComponentRole.DECODE),
        render_router_service(pds),
        render_router_deployment(pds, defaults),
        render_prefill_statefulset(pds, defaults),
        render_decode_statefulset(pds, defaults),
        *render_scalers(pds),
    ]
