"""Where the tier keeps its blocks: one host buffer per rank, a slot per block, and the copies between it
and the rank's KV cache.

A slot holds one block of every region the rank registers for transfer (``pdconnector.layout.regions``): in
any placement a block is one run of ``block_stride`` bytes inside each region (one region per layer slot when
layer-outer, one region when block-outer or head-outer), so a slot is those runs back to back and a copy is
one indexed gather or scatter per region, whatever the layout. Copies are synchronous on the calling thread
(the engine's, in the order the scheduler staged them: a slot a later save reuses is read first); the index
(:mod:`pdconnector.tier.index`) says which slots may be read or written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdconnector.layout.regions import Region


class TierStore:
    def __init__(self, regions: Sequence[Region], capacity_slots: int, *, pin_memory: bool = False) -> None:
        if not regions:
            raise ValueError("a tier store needs the rank's regions")
        if capacity_slots < 1:
            raise ValueError(f"a tier store needs at least one slot, got {capacity_slots}")
        self.regions = tuple(regions)
        self.offsets = [slot_bytes(self.regions[:i]) for i in range(len(self.regions))]
        self.slot_bytes = slot_bytes(self.regions)
        # pinned on GPU engines, so copies to and from the device run at full speed
        self.buffer = torch.empty((capacity_slots, self.slot_bytes), dtype=torch.uint8, pin_memory=pin_memory)

    @property
    def capacity_slots(self) -> int:
        return self.buffer.shape[0]

    def save(self, caches: Sequence[torch.Tensor], block_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Copy the blocks ``block_ids`` of the rank's caches (one tensor per region) into ``slots``."""
        blocks, where = self._indices(caches, block_ids, slots)
        for region, cache, offset in zip(self.regions, caches, self.offsets, strict=True):
            runs = _blocks_view(cache, region).index_select(0, blocks.to(cache.device))
            self.buffer[where, offset : offset + region.block_stride] = runs.to("cpu")

    def load(self, caches: Sequence[torch.Tensor], slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy ``slots`` into the blocks ``block_ids`` of the rank's caches."""
        blocks, where = self._indices(caches, block_ids, slots)
        for region, cache, offset in zip(self.regions, caches, self.offsets, strict=True):
            runs = self.buffer[where, offset : offset + region.block_stride]
            _blocks_view(cache, region).index_copy_(0, blocks.to(cache.device), runs.to(cache.device))

    def _indices(
        self, caches: Sequence[torch.Tensor], block_ids: Sequence[int], slots: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if len(caches) != len(self.regions):
            raise ValueError(
                f"expected {len(self.regions)} cache tensors (one per region), got {len(caches)}"
            )
        if len(block_ids) != len(slots):
            raise ValueError(f"{len(block_ids)} blocks for {len(slots)} slots")
        if len(set(slots)) != len(slots) or len(set(block_ids)) != len(block_ids):
            raise ValueError("a copy names each block and each slot once")
        num_blocks = min(r.num_blocks for r in self.regions)
        if any(not 0 <= b < num_blocks for b in block_ids):
            raise ValueError(f"block ids {list(block_ids)} outside the cache's {num_blocks} blocks")
        if any(not 0 <= s < self.capacity_slots for s in slots):
            raise ValueError(f"slots {list(slots)} outside the tier's {self.capacity_slots}")
        return torch.tensor(list(block_ids), dtype=torch.long), torch.tensor(list(slots), dtype=torch.long)


class RankTier:
    """A rank's tier: its store bound to the rank's cache tensors (one per region). A save that fails here is
    reported to the scheduler side (:class:`~pdconnector.vllm.metadata.TierFailures`), which then frees its
    slots instead of making them readable, so no load ever reads a slot this rank did not fill."""

    def __init__(self, store: TierStore, caches: Sequence[torch.Tensor]) -> None:
        self.store = store
        self.caches = tuple(caches)

    def save(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        self.store.save(self.caches, block_ids, slots)

    def load(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        self.store.load(self.caches, slots, block_ids)


def slot_bytes(regions: Sequence[Region]) -> int:
    """One block of every region, back to back: what a slot holds."""
    return sum(region.block_stride for region in regions)


def _blocks_view(cache: torch.Tensor, region: Region) -> torch.Tensor:
    """``cache`` (a region's registered tensor, any dtype) as ``num_blocks`` rows of ``block_stride``
    bytes."""
    if not cache.is_contiguous() or cache.numel() * cache.element_size() != region.nbytes:
        raise ValueError(
            f"region {region.index}: expected a contiguous tensor of {region.nbytes} bytes, got "
            f"{cache.numel() * cache.element_size()}"
        )
    return cache.view(torch.uint8).view(region.num_blocks, region.block_stride)
