"""Names and labels of a PDService's children (the contract in ARCHITECTURE.md)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pdoperator.api.model import API_VERSION, GROUP, KIND, PDService

ROUTER_HTTP_PORT = 8000

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_ROLE = f"{GROUP}/role"
LABEL_COMPAT = f"{GROUP}/compat"

PRODUCT = "pd-operator"


class ComponentRole(StrEnum):
    """A child's ``inference.pdoperator.dev/role`` label; the engine roles are the data plane's
    ``EngineRole``."""

    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"


ENGINE_ROLES = (ComponentRole.PREFILL, ComponentRole.DECODE)


def child_name(pds: PDService, role: ComponentRole) -> str:
    """``<name>-prefill``, ``<name>-decode``, ``<name>-router``: every child of a role shares it."""
    return f"{pds.name}-{role.value}"


def selector_labels(pds: PDService, role: ComponentRole) -> dict[str, str]:
    """The labels that select one role's pods; immutable on a workload, so nothing here may change over its
    life."""
    return {LABEL_NAME: PRODUCT, LABEL_INSTANCE: pds.name, LABEL_ROLE: role.value}


def instance_labels(pds: PDService) -> dict[str, str]:
    """The labels every pod of this PDService carries."""
    return {LABEL_NAME: PRODUCT, LABEL_INSTANCE: pds.name}


def managed_labels(pds: PDService, component: str) -> dict[str, str]:
    """Labels of an object serving the whole PDService rather than one role."""
    return {**instance_labels(pds), LABEL_COMPONENT: component, LABEL_MANAGED_BY: PRODUCT}


def object_labels(pds: PDService, role: ComponentRole) -> dict[str, str]:
    """Labels of a role's objects (and pods): every child carries the instance label the operator watches
    by."""
    return {**selector_labels(pds, role), LABEL_COMPONENT: role.value, LABEL_MANAGED_BY: PRODUCT}


def object_meta(pds: PDService, role: ComponentRole, name: str | None = None) -> dict[str, Any]:
    return {
        "name": name or child_name(pds, role),
        "namespace": pds.namespace,
        "labels": object_labels(pds, role),
    }


def pod_name(pds: PDService, role: ComponentRole, ordinal: int) -> str:
    return f"{child_name(pds, role)}-{ordinal}"


def service_dns_name(pds: PDService, role: ComponentRole, cluster_domain: str) -> str:
    return f"{child_name(pds, role)}.{pds.namespace}.svc.{cluster_domain}"


def pod_dns_name(pds: PDService, role: ComponentRole, ordinal: int, cluster_domain: str) -> str:
    """The stable name a StatefulSet pod gets through its headless Service."""
    return f"{pod_name(pds, role, ordinal)}.{service_dns_name(pds, role, cluster_domain)}"


def owner_reference(pds: PDService) -> dict[str, Any]:
    """The controller reference the operator puts on every child (garbage collection, watches)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": pds.name,
        "uid": pds.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
