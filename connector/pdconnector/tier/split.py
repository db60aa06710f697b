"""Where decode takes a request's prompt blocks from: its own prefix cache, its tier, then prefill (sans-I/O).

vLLM allocates a decode request's blocks after the leading ones its prefix cache hit; our connector fills the
rest. With a tier, the longest run of those blocks whose hashes the tier holds (readable, consecutive from the
first block to fill) is loaded from host memory, and only the blocks after that run come from prefill: the
registration's ``cached_blocks`` grows by the run, so prefill skips it (push), or decode reads only the rest
(pull). Each block has exactly one source, so no block is moved twice. The run's slots are pinned in the index
(:meth:`TierIndex.pin`) until the caller unpins them: for as long as the load may still read them, no save can
evict them. Today's loads are copies each rank makes when it takes its command, before any later command's
save, so the caller unpins at once (:meth:`pdconnector.vllm.tier_plan.TierPlan.split`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdconnector.tier.index import BlockHash, TierIndex


@dataclass(frozen=True)
class PrefixSplit:
    """The sources of the blocks decode fills, in prompt order: ``tier_blocks`` (loaded from ``tier_slots``,
    pinned under ``tier_hashes``), then ``remote_blocks`` (from prefill, which skips ``cached_blocks``)."""

    tier_blocks: tuple[int, ...]
    tier_slots: tuple[int, ...]
    tier_hashes: tuple[BlockHash, ...]
    remote_blocks: tuple[int, ...]
    cached_blocks: int  # leading blocks decode holds without prefill: prefix-cache hits, then the tier run


def split_prefix(
    to_fill: Sequence[int], block_hashes: Sequence[BlockHash], gpu_hits: int, index: TierIndex
) -> PrefixSplit:
    """Split the blocks decode must fill (``to_fill``: block ids after its ``gpu_hits`` prefix-cache hits, in
    prompt order) between the tier and prefill. ``block_hashes``: the request's hashes of its full blocks
    (vLLM's ``request.block_hashes``), from the first block of the prompt.

    Pins the tier run: the caller unpins ``tier_hashes`` once no load can read it any more."""
    if gpu_hits < 0 or gpu_hits > len(block_hashes):
        raise ValueError(f"{gpu_hits} prefix-cache hits for a prompt of {len(block_hashes)} full blocks")
    # Only full blocks have hashes: a partial last block is never in the tier; it always comes from prefill.
    candidates = block_hashes[gpu_hits : gpu_hits + len(to_fill)]
    run = len(index.longest_prefix(candidates))
    tier_hashes = tuple(candidates[:run])
    slots = tuple(index.pin(tier_hashes)) if run else ()
    return PrefixSplit(
        tier_blocks=tuple(to_fill[:run]),
        tier_slots=slots,
        tier_hashes=tier_hashes,
        remote_blocks=tuple(to_fill[run:]),
        cached_blocks=gpu_hits + run,
    )
