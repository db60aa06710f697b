"""Where engines keep KV beyond GPU memory (``spec.kvCache``).

``offload.decode``: a tier in each decode engine's host memory. What a decode request received and generated
stays there after it finished; the next turn of the conversation, which resends that history, loads it from
the tier and asks prefill only for the new suffix. ``offload.prefill``: a tier in each prefill engine's host
memory, holding the prompts it computed, so the next turn loads their KV instead of computing it again
(``docs/design/kv-offload.md``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pdoperator.api.base import QUANTITY, ApiModel


class TierSpec(ApiModel):
    """A KV tier in host memory for one role's engines."""

    host_memory: Annotated[
        str,
        Field(
            description="Host memory per engine pod for the tier (Kubernetes quantity, e.g. 64Gi), split "
            "evenly over the pod's ranks and added to the pod's memory request and limit.",
            pattern=QUANTITY,
        ),
    ]


class OffloadSpec(ApiModel):
    """KV tiers per role; unset: none (the engines hold KV in GPU memory only)."""

    prefill: Annotated[
        TierSpec | None,
        Field(
            description="Prefill's tier: the prompts prefill computed (their full blocks, saved once their "
            "KV left for decode) are loaded from it when a later prompt starts with them, instead of "
            "computed again. Needs spec.prefill.resources.memory; not for hybrid-ssm models."
        ),
    ] = None

    decode: Annotated[
        TierSpec | None,
        Field(
            description="Decode's tier: the history of a conversation that decode received and generated is "
            "loaded from it on the next turn, so prefill sends only the new suffix. Needs "
            "spec.decode.resources.memory; not for hybrid-ssm models."
        ),
    ] = None


class KVCacheSpec(ApiModel):
    """KV cache placement beyond GPU memory."""

    offload: Annotated[OffloadSpec, Field(description="KV tiers in host memory.")] = Field(
        default_factory=OffloadSpec
    )
