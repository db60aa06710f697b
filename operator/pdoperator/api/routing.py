"""``spec.router.policy`` and ``spec.router.cacheAware``: how the router picks an engine within each role."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field

from pdoperator.api.base import ApiModel

# vLLM's default KV block size on GPUs (the CPU backend's is 128).
DEFAULT_BLOCK_SIZE = 16
MAX_WEIGHT = 1000


class RoutingPolicy(StrEnum):
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"
    CACHE_AWARE = "cache-aware"


class CacheAwareSpec(ApiModel):
    """The cache-aware policy: prefill where the prompt's prefix is cached, weighed against the work queued
    there; decode where KV headroom is largest. The engines publish vLLM's KV cache events to the router."""

    block_size: Annotated[
        int,
        Field(
            description="The engines' KV block size in tokens (rendered as vLLM's --block-size on both "
            "roles, so the router hashes prompts as the engines do).",
            ge=1,
            le=1024,
        ),
    ] = DEFAULT_BLOCK_SIZE
    prefix_weight: Annotated[
        int,
        Field(
            description="Worth of one cached prompt token against one token of prefill work.",
            ge=0,
            le=MAX_WEIGHT,
        ),
    ] = 1
    tier_weight_percent: Annotated[
        int,
        Field(
            description="Prefill: worth of a prompt token in an engine's KV tier (spec.kvCache.offload) "
            "against one in its GPU cache, in percent of prefixWeight (loaded, not computed). Decode counts "
            "the tokens its tier holds as held.",
            ge=0,
            le=100,
        ),
    ] = 80
    load_weight: Annotated[
        int,
        Field(description="Weight of the prompt tokens already queued at a prefill.", ge=0, le=MAX_WEIGHT),
    ] = 1
    max_imbalance: Annotated[
        int,
        Field(
            description="Most requests an engine may have outstanding beyond the least busy one of its role "
            "and still be chosen for its cache.",
            ge=0,
            le=65536,
        ),
    ] = 4
    kv_usage_weight: Annotated[
        int,
        Field(
            description="Decode: a full KV cache counts as this many running sequences.", ge=0, le=MAX_WEIGHT
        ),
    ] = 4


class RetriesSpec(ApiModel):
    """How hard the router tries a request whose prefill or decode leg failed for a reason of the engine's
    (unreachable, broken off, ejected by the health checks, aborted, its KV transfer failed) before any token
    reached its client: again on another prefill/decode pair, with a new transfer."""

    attempts: Annotated[
        int,
        Field(description="Most prefill/decode pairs a request is tried on (1: never retried).", ge=1, le=10),
    ] = 3
    budget_seconds: Annotated[
        int,
        Field(description="A failed request is tried again only this long after it arrived.", ge=1, le=3600),
    ] = 30
