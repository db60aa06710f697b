"""The KV tier's memory on a vLLM engine: how many blocks ``tier_bytes`` hold (the scheduler and every rank
derive the same number from the same KV cache config, so a slot the scheduler hands out exists on every rank)
and a rank's store, bound to views of the memory it registered for transfer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig

from pdconnector.layout import RankLayout
from pdconnector.tier.store import RankTier, TierStore, slot_bytes
from pdconnector.transport.base import Device, MemoryRegion
from pdconnector.vllm.config import ConnectorConfigError
from pdconnector.vllm.kv_layout import all_layer_tensors

TIER_BYTES_KEY = "kv_connector_extra_config.tier_bytes"


def block_bytes(kv_cache_config: KVCacheConfig) -> int:
    """One block of every layer of this rank: what a tier slot holds."""
    total = sum(tensor.size for tensor in kv_cache_config.kv_cache_tensors)
    return total // kv_cache_config.num_blocks


def tier_slots(tier_bytes: int, kv_cache_config: KVCacheConfig) -> int:
    """The blocks ``tier_bytes`` of host memory hold per rank. Refuses a tier too small for one block, and a
    model whose KV cache is not one group of full attention: SSM state is rewritten in place, and vLLM
    replaces the blocks a sliding window left behind with its null block in the lists the tier saves from."""
    if not tier_bytes:
        return 0
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        kinds = ", ".join(type(group.kv_cache_spec).__name__ for group in groups)
        raise ConnectorConfigError(
            TIER_BYTES_KEY, f"the KV tier holds one group of full attention; this model's KV cache is {kinds}"
        )
    per_block = block_bytes(kv_cache_config)
    if tier_bytes < per_block:
        raise ConnectorConfigError(
            TIER_BYTES_KEY,
            f"{tier_bytes} bytes hold no block of this model ({per_block} bytes per block per rank)",
        )
    return tier_bytes // per_block


def rank_tier(
    layout: RankLayout,
    kv_cache_config: KVCacheConfig,
    kv_caches: Mapping[str, Any],
    regions: Sequence[MemoryRegion],
    tier_bytes: int,
) -> RankTier:
    """This rank's tier: ``tier_slots`` slots in host memory (pinned when the cache is on a GPU) and byte
    views of the registered regions to copy between."""
    slots = tier_slots(tier_bytes, kv_cache_config)
    # checked before the host buffer is allocated: a refused tier takes no memory
    if (registered := slot_bytes(layout.regions)) != block_bytes(kv_cache_config):
        raise ConnectorConfigError(
            TIER_BYTES_KEY,
            f"a block of the registered regions is {registered} bytes, vLLM's cache config says "
            f"{block_bytes(kv_cache_config)}: the tier's slots would not fit its blocks",
        )
    store = TierStore(layout.regions, slots, pin_memory=regions[0].device is Device.VRAM)
    tensors = all_layer_tensors(kv_caches)
    return RankTier(store, [_region_view(region, tensors) for region in regions])


def _region_view(region: MemoryRegion, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A uint8 view of ``region`` in the allocation (vLLM's KV cache buffer) that holds it."""
    for tensor in tensors:
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        if start <= region.addr and region.addr + region.nbytes <= start + storage.nbytes():
            view = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            return view.set_(storage, region.addr - start, (region.nbytes,))
    raise ValueError(f"no KV cache tensor holds the region at {region.addr:#x} ({region.nbytes} bytes)")
