"""The KV tier on the scheduler side: which of a decode request's blocks its tier supplies, and which blocks
of a finished request it saves (sans-I/O over vLLM's requests; the copies are the worker side's).

vLLM hashes a request's tokens in blocks of ``hash_block_size`` tokens, each hash chained over the whole
prefix; a block of the attention group (``block_size``, a multiple) is named by the hash of its last hash
block. The index (:class:`~pdconnector.tier.index.TierIndex`) maps those hashes to slots; a hash becomes
readable once every rank copied its block (``finished_sending``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdconnector.tier.index import BlockHash, TierIndex
from pdconnector.tier.split import PrefixSplit, split_prefix
from pdconnector.vllm.metadata import SaveToTier


class TierPlan:
    def __init__(self, slots: int, *, block_size: int, hash_block_size: int) -> None:
        if block_size % hash_block_size:
            raise ValueError(
                f"block size {block_size} is not a multiple of the hash block size {hash_block_size}"
            )
        self.index = TierIndex(slots)
        self.block_size = block_size
        self._hashes_per_block = block_size // hash_block_size
        self._saving: dict[str, tuple[BlockHash, ...]] = {}  # request id -> the hashes its save writes

    def split(self, request: Any, to_fill: Sequence[int], gpu_hits: int) -> PrefixSplit:
        """Where ``to_fill`` (the blocks after vLLM's ``gpu_hits`` prefix-cache hits) comes from."""
        split = split_prefix(to_fill, self.block_hashes(request), gpu_hits, self.index)
        # The load runs when a rank takes its command, before any save staged later can reuse these slots
        # (LoadFromTier), so nothing needs them pinned past this step.
        self.index.unpin(split.tier_hashes)
        return split

    def save(self, request: Any, block_ids: Sequence[int]) -> SaveToTier | None:
        """The save of a finished request's computed full blocks (``block_ids``: its attention blocks) that
        the tier lacks, or None; the request's blocks stay allocated until :meth:`saved`."""
        # The last sampled token has no KV yet: only blocks of computed tokens are saved.
        computed = int(request.num_computed_tokens) // self.block_size
        hashes = self.block_hashes(request)[: min(computed, len(block_ids))]
        reserved = self.index.reserve(hashes)
        if not reserved:
            return None
        saved = [
            (block, block_hash)
            for block, block_hash in zip(block_ids, hashes, strict=False)
            if block_hash in reserved
        ]
        self._saving[request.request_id] = tuple(block_hash for _, block_hash in saved)
        return SaveToTier(
            request.request_id,
            tuple(block for block, _ in saved),
            tuple(reserved[block_hash] for _, block_hash in saved),
        )

    def saved(self, request_id: str) -> None:
        """Every rank copied the request's blocks (or it had no save here)."""
        hashes = self._saving.pop(request_id, None)
        if hashes is not None:
            self.index.commit(hashes)

    def block_hashes(self, request: Any) -> list[BlockHash]:
        """The request's hashes at the attention group's block size, from its first block."""
        hashes = list(getattr(request, "block_hashes", ()) or ())
        step = self._hashes_per_block
        return hashes[step - 1 :: step]
