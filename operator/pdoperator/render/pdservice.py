"""All manifests of one PDService, in apply order."""

from __future__ import annotations

from typing import Any

from pdoperator.api.model import PDService

from .defaults import RenderDefaults
from .disruption_budget import render_pod_disruption_budgets
from .engine_group import render_engine_leader_worker_set
from .identity import role_spec
from .names import ComponentRole
from .network_policy import render_network_policies
from .router import render_router_configmap, render_router_deployment
from .scalers import render_scalers
from .service import render_headless_service, render_router_service
from .statefulset import render_engine_statefulset


def render_pdservice(pds: PDService, defaults: RenderDefaults) -> list[dict[str, Any]]:
    """The children of a validated PDService (without owner references), in the order to apply them.

    Pure and deterministic: equal inputs give equal, freshly built objects. The order
    follows Helm's install order (policies, config, services, then workloads), so the
    engines' governing Services exist before their workloads and the router's
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
        render_engine_workload(pds, ComponentRole.PREFILL, defaults),
        render_engine_workload(pds, ComponentRole.DECODE, defaults),
        *render_scalers(pds),
    ]


def render_engine_workload(pds: PDService, role: ComponentRole, defaults: RenderDefaults) -> dict[str, Any]:
    """A role's engines: a StatefulSet of one pod per engine, or a LeaderWorkerSet of one pod group per
    engine where an engine spans nodes."""
    if role_spec(pds.spec, role).spans_nodes:
        return render_engine_leader_worker_set(pds, role, defaults)
    return render_engine_statefulset(pds, role, defaults)
