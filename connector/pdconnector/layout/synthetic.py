"""Synthetic KV pools for byte-exact transfer checks, shaped by a :class:`RankLayout`.

A logical unit (one attention kernel block or one SSM block of one region) has global
content that depends only on its *tag*, the region and the byte position in the unsharded
segment; each TP rank holds its shard of it. A prefill rank fills its pools with
:func:`write_tagged_blocks` using its block ids as tags; a decode rank computes what it must
hold afterwards by writing the same tags (the prefill block ids) at its own block ids into a
copy of its pools. Padding and blocks outside the request are never written, so a
byte-for-byte comparison also proves they stayed untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdconnector.layout.model import LayerKind
from pdconnector.layout.plan import TransferPlan
from pdconnector.layout.regions import PageSchema, RankLayout

_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(0x165667B19E3779F9), np.uint64(0xD6E8FEB86659FD93))


def allocate_pools(layout: RankLayout, fill: int = 0) -> list[np.ndarray]:
    """One zeroed (or ``fill``-ed) uint8 buffer per registered region."""
    return [np.full(r.nbytes, fill, dtype=np.uint8) for r in layout.regions]


def tagged_shard(schema: PageSchema, tp_rank: int, region: int, tags: np.ndarray) -> np.ndarray:
    """``(len(tags), schema.nbytes)`` bytes: this rank's shard of the tagged global pages."""
    tags = np.asarray(tags, dtype=np.uint64)
    out = np.empty((tags.size, schema.nbytes), dtype=np.uint8)
    for seg, (offset, size) in enumerate(zip(schema.offsets.tolist(), schema.sizes.tolist(), strict=True)):
        global_pos = np.arange(tp_rank * size, (tp_rank + 1) * size, dtype=np.uint64)
        with np.errstate(over="ignore"):
            seed = (tags[:, None] * _MIX[0]) ^ (np.uint64(region * 1031 + seg + 1) * _MIX[1])
            x = seed ^ (global_pos[None, :] * _MIX[2])
            x = (x ^ (x >> np.uint64(29))) * _MIX[3]
            x ^= x >> np.uint64(32)
        out[:, offset : offset + size] = (x & np.uint64(0xFF)).astype(np.uint8)
    return out


def write_tagged_blocks(
    layout: RankLayout,
    pools: Sequence[np.ndarray],
    blocks: Sequence[Sequence[int]],
    tags: Sequence[Sequence[int]],
    *,
    num_tokens: int | None = None,
) -> None:
    """Write this rank's shard of the content tagged ``tags[g]`` at logical ``blocks[g]`` of every
    region of KV group ``g`` (attention: every kernel block, or those holding ``num_tokens``)."""
    ratio = layout.model.physical_blocks_per_logical
    for group in layout.groups:
        ids = np.asarray(blocks[group.index], dtype=np.int64).reshape(-1)
        unit_tags = np.asarray(tags[group.index], dtype=np.int64).reshape(-1)
        if group.kind is LayerKind.ATTENTION:
            ids = (ids[:, None] * ratio + np.arange(ratio)).ravel()
            unit_tags = (unit_tags[:, None] * ratio + np.arange(ratio)).ravel()
            if num_tokens is not None:
                keep = -(-num_tokens // layout.model.kernel_block_size)
                ids, unit_tags = ids[:keep], unit_tags[:keep]
            schema, stride = layout.attention_schema, layout.physical_page_bytes
        else:
            schema, stride = layout.ssm_schema, layout.page_bytes
            # SSM content must differ from attention content that may sit in the same bytes.
            unit_tags = unit_tags + (1 << 40)
        for region in group.regions:
            pages = tagged_shard(schema, layout.tp_rank, region, unit_tags)
            rows = pools[region].reshape(-1)
            targets = ids[:, None] * stride + np.arange(schema.nbytes)
            rows[targets] = pages


def apply_plan(plan: TransferPlan, src_pools: Sequence[np.ndarray], dst_pools: Sequence[np.ndarray]) -> None:
    """Copy every run of ``plan`` from the source pools into the destination pools (a local transport)."""
    for sr, so, dr, do, n in zip(
        plan.src_region.tolist(), plan.src_offset.tolist(), plan.dst_region.tolist(), plan.dst_offset.tolist(), plan.length.tolist(), strict=True
    ):
        dst_pools[dr][do : do + n] = src_pools[sr][so : so + n]
