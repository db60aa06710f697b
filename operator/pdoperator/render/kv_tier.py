"""The KV tier in the rendered engines (``spec.kvCache.offload``): the host memory each rank's connector takes
(``kv_connector_extra_config.tier_bytes``) and the pod memory that covers it."""

from __future__ import annotations

from decimal import Decimal

from kubernetes.utils.quantity import parse_quantity

from pdoperator.api.model import PDServiceSpec

from .identity import role_spec
from .names import ComponentRole


def tier_host_memory(spec: PDServiceSpec, role: ComponentRole) -> Decimal:
    """Bytes of host memory a pod of ``role`` gives its KV tier (0: no tier)."""
    offload = spec.kv_cache.offload
    tier = {ComponentRole.PREFILL: offload.prefill, ComponentRole.DECODE: offload.decode}.get(role)
    return Decimal(0) if tier is None else parse_quantity(tier.host_memory)


def tier_bytes_per_rank(spec: PDServiceSpec, role: ComponentRole) -> int:
    """The tier's share of each rank of a pod of ``role``: each rank keeps the blocks of its own heads."""
    rs = role_spec(spec, role)
    return int(tier_host_memory(spec, role)) // (rs.world_size // rs.nodes)


def pod_memory(spec: PDServiceSpec, role: ComponentRole, memory: str) -> str:
    """``memory`` (the role's request and limit) grown by the pod's tier, in the largest binary unit that
    states it exactly."""
    tier = tier_host_memory(spec, role)
    if not tier:
        return memory
    total = int(parse_quantity(memory) + tier)
    for suffix, unit in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if total % unit == 0:
            return f"{total // unit}{suffix}"
    return str(total)
