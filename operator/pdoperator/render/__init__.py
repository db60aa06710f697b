"""Rendering: a validated PDService to the Kubernetes manifests of its children.

Pure functions of (PDService, RenderDefaults); one module per kind of resource, and one
engine pod builder shared by prefill and decode (``engine``).
"""

from .defaults import OPERATOR_IMAGE, OPERATOR_VERSION, RenderDefaults
from .identity import compatibility_hash, engine_id
from .names import (
    LABEL_COMPAT,
    LABEL_INSTANCE,
    LABEL_ROLE,
    ComponentRole,
    child_name,
    owner_reference,
    selector_labels,
)
from .pdservice import render_pdservice
from .router import build_router_config

__all__ = [
    "LABEL_COMPAT",
    "LABEL_INSTANCE",
    "LABEL_ROLE",
    "OPERATOR_IMAGE",
    "OPERATOR_VERSION",
    "ComponentRole",
    "RenderDefaults",
    "build_router_config",
    "child_name",
    "compatibility_hash",
    "engine_id",
    "owner_reference",
    "render_pdservice",
    "selector_labels",
]
