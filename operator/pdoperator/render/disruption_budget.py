"""PodDisruptionBudgets: voluntary evictions (node drains, upgrades) take one pod of a role at a time."""

from __future__ import annotations

from typing import Any

from pdoperator.api.model import PDService

from .names import ComponentRole, object_meta, selector_labels


def render_pod_disruption_budget(pds: PDService, role: ComponentRole) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(pds, role),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(pds, role)}},
    }


def render_pod_disruption_budgets(pds: PDService) -> list[dict[str, Any]]:
    """One budget per role, whatever the replica count.

    maxUnavailable 1 limits a role of several pods to one eviction at a time and never
    blocks a drain of a single-pod role (unlike minAvailable 1). Rendering the budgets
    independently of replicas keeps the set of children fixed, so scaling only patches
    the workload and the router config.
    """
    return [render_pod_disruption_budget(pds, role) for role in ComponentRole]
