"""The cache-aware policy's scores: which prefill will finish a request's prompt first given what it has
cached, and which decode has the room to take it.

Prefill: the tokens an engine must compute before this request's prompt is done, that is the uncached
prompt tokens of the requests already chosen for it plus this prompt less the prefix the engine holds (in its
GPU cache, then in its KV tier, where a token is worth ``tier_weight`` of a cached one: loaded, not
computed). A prefix is worth only what it saves against load, so a hot prefix does not pile every request
onto one engine; and an engine with ``max_imbalance`` more outstanding requests than the least loaded one is
not a candidate at all.

Decode: load first (running and waiting sequences, the engine's own count when its metrics are known, so
other routers' requests count too), then how full its KV cache is; the share of the prompt it holds (in its
cache or its tier) is worth up to one sequence, since the connector then moves only the blocks decode lacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdconnector.router.backends import Backend

# A decode engine this full is a candidate only when all are: admitting more would preempt.
FULL_KV_USAGE = 0.95


@dataclass(frozen=True)
class CacheAwareWeights:
    prefix_weight: float = 1.0  # a cached prompt token is worth this many tokens of queued work
    tier_weight: float = 0.8  # a prompt token in the engine's KV tier is worth this share of a cached one
    load_weight: float = 1.0  # a queued prompt token ahead of this request costs this much
    max_imbalance: int = 4  # outstanding requests above the least loaded engine that exclude a prefill
    kv_usage_weight: float = 4.0  # a full decode KV cache weighs as this many more sequences


@dataclass(frozen=True)
class PromptBlocks:
    """The request's prompt as the cache sees it: its length and its full blocks' hashes."""

    token_count: int
    block_size: int
    hashes: tuple[int, ...]

    def cached_tokens(self, backend: Backend) -> int:
        """The leading tokens ``backend`` holds in its GPU cache."""
        if backend.prefix_index is None or not self.hashes:
            return 0
        return backend.prefix_index.matched_blocks(self.hashes) * self.block_size

    def tier_tokens(self, backend: Backend) -> int:
        """The tokens after those that ``backend`` holds in its KV tier (it loads that run from there)."""
        if backend.tier_index is None or not self.hashes:
            return 0
        cached = self.cached_tokens(backend) // self.block_size
        return backend.tier_index.matched_blocks(self.hashes[cached:]) * self.block_size

    def tokens_to_compute(self, backend: Backend) -> int:
        """What a prefill ``backend`` computes of this prompt: neither cached nor in its tier."""
        return self.token_count - self.cached_tokens(backend) - self.tier_tokens(backend)


def prefill_costs(
    candidates: Sequence[Backend], prompt: PromptBlocks, weights: CacheAwareWeights
) -> dict[str, float]:
    """Each eligible candidate's cost in tokens of work ahead of this prompt's end; the imbalance bound
    leaves out the rest."""
    least = min(b.outstanding for b in candidates)
    eligible = [b for b in candidates if b.outstanding <= least + weights.max_imbalance]
    return {
        b.name: weights.load_weight * b.queued_prompt_tokens
        + prompt.token_count
        - weights.prefix_weight * (prompt.cached_tokens(b) + weights.tier_weight * prompt.tier_tokens(b))
        for b in eligible
    }


def decode_costs(
    candidates: Sequence[Backend], prompt: PromptBlocks | None, weights: CacheAwareWeights
) -> dict[str, float]:
    """Each eligible candidate's cost in sequences; a nearly full engine is left out while another has
    room."""
    roomy = [b for b in candidates if (b.kv_usage or 0.0) < FULL_KV_USAGE] or list(candidates)
    costs = {}
    for backend in roomy:
        load = max(backend.outstanding, backend.engine_sequences or 0)
        share_cached = 0.0
        if prompt is not None and prompt.token_count:
            share_cached = (prompt.cached_tokens(backend) + prompt.tier_tokens(backend)) / prompt.token_count
        costs[backend.name] = load + weights.kv_usage_weight * (backend.kv_usage or 0.0) - share_cached
    return costs
