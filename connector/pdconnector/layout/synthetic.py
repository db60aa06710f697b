"""Synthetic KV pools for byte-exact transfer checks, shaped by a :class:`RankLayout`.

A logical unit (one attention kernel block or one SSM block of one region) has global
content that depends only on its *tag*, the region and the byte position in the unsharded
segment; each TP rank holds its shard of it. A prefill rank fills its pools with
:func:`write_tagged_blocks` using its block ids as tags; a decode rank computes what it must
hold afterwards by writing the same tags (the prefill block ids) at its own block ids into a
copy of its pools. Padding and blocks outside the request are never written, so a
byte-for-byte comparison also proves they stayed untouched.

Pools are numpy arrays or torch tensors on any device; the content is computed where the pools
live (GBs of VRAM are tagged and compared on the GPU) and is the same bits either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdconnector.layout.model import LayerKind
from pdconnector.layout.plan import TransferPlan
from pdconnector.layout.regions import BlockPlacement, PageSchema, RankLayout

_MIX = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_WORD = (1 << 64) - 1


@dataclass(frozen=True)
class _Backend:
    """Arrays where the pools live: numpy on the host, or torch on ``device``.

    Words are 64 bits: numpy ``uint64``, torch ``int64`` (torch's unsigned types lack arithmetic).
    Multiplication wraps alike and constants go in as their two's-complement value; only right shifts differ
    (arithmetic in int64), so the mixing masks every shift to make it logical and both compute the same
    bits."""

    torch: Any = None
    device: Any = None

    @classmethod
    def of(cls, array: Any) -> _Backend:
        if isinstance(array, np.ndarray | Sequence):
            return cls()
        import torch  # noqa: PLC0415 (only torch pools need it)

        return cls(torch, array.device)

    def ints(self, values: np.ndarray) -> Any:
        """An int64 index array."""
        return (
            values
            if self.torch is None
            else self.torch.as_tensor(values, dtype=self.torch.int64, device=self.device)
        )

    def words(self, values: Any) -> Any:
        if self.torch is None:
            return np.asarray(values, dtype=np.uint64)
        return self.torch.as_tensor(values, dtype=self.torch.int64, device=self.device)

    def word(self, value: int) -> Any:
        value &= _WORD
        return np.uint64(value) if self.torch is None else value - (1 << 64) * (value >> 63)

    def word_range(self, start: int, stop: int) -> Any:
        if self.torch is None:
            return np.arange(start, stop, dtype=np.uint64)
        return self.torch.arange(start, stop, dtype=self.torch.int64, device=self.device)

    def empty_bytes(self, rows: int, cols: int) -> Any:
        if self.torch is None:
            return np.empty((rows, cols), dtype=np.uint8)
        return self.torch.empty((rows, cols), dtype=self.torch.uint8, device=self.device)


def allocate_pools(layout: RankLayout, fill: int = 0) -> list[np.ndarray]:
    """One zeroed (or ``fill``-ed) uint8 buffer per registered region."""
    return [np.full(r.nbytes, fill, dtype=np.uint8) for r in layout.regions]


def tagged_shard(schema: PageSchema, tp_rank: int, region: int, tags: Any) -> Any:
    """``(len(tags), schema.nbytes)`` bytes: this rank's shard of the tagged global pages.

    ``tags``: integers (numpy or a list: the result is a numpy array) or a torch tensor (the result is on its
    device)."""
    xp = _Backend.of(tags)
    tags = xp.words(tags)
    out = xp.empty_bytes(int(tags.shape[0]), schema.nbytes)
    starts = schema.starts(tp_rank).tolist()
    for seg, (offset, size) in enumerate(zip(schema.offsets.tolist(), schema.sizes.tolist(), strict=True)):
        seed = (tags[:, None] * xp.word(_MIX[0])) ^ xp.word((region * 1031 + seg + 1) * _MIX[1])
        x = seed ^ (xp.word_range(starts[seg], starts[seg] + size)[None, :] * xp.word(_MIX[2]))
        x ^= (x >> 29) & ((1 << 35) - 1)
        x *= xp.word(_MIX[3])
        x ^= (x >> 32) & ((1 << 32) - 1)
        out[:, offset : offset + size] = x & 0xFF
    return out


def write_tagged_blocks(
    layout: RankLayout,
    pools: Sequence[Any],
    blocks: Sequence[Sequence[int]],
    tags: Sequence[Sequence[int]],
    *,
    num_tokens: int | None = None,
) -> None:
    """Write this rank's shard of the content tagged ``tags[g]`` at logical ``blocks[g]`` of every
    region of KV group ``g`` (attention: every kernel block, or those holding ``num_tokens``).

    ``pools``: one flat uint8 buffer per region, numpy arrays or torch tensors (written on their device)."""
    xp = _Backend.of(pools[0])
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
            schema = layout.attention_schema
        else:
            schema = layout.ssm_schema
            # SSM content must differ from attention content that may sit in the same bytes.
            unit_tags = unit_tags + (1 << 40)
        index = xp.ints(ids)
        for slot in group.slots:
            _unit_pages(layout, group.kind, pools, slot)[index] = _unit_shape(
                layout, tagged_shard(schema, layout.tp_rank, slot, xp.words(unit_tags))
            )


def _unit_pages(layout: RankLayout, kind: LayerKind, pools: Sequence[Any], slot: int) -> Any:
    """A writable view of one slot's real bytes, one row per unit (kernel block or logical block)."""
    nbytes = (layout.attention_schema if kind is LayerKind.ATTENTION else layout.ssm_schema).nbytes
    match layout.placement:
        case BlockPlacement.LAYER_OUTER:
            stride = layout.physical_page_bytes if kind is LayerKind.ATTENTION else layout.page_bytes
            return pools[slot].reshape(-1, stride)[:, :nbytes]
        case BlockPlacement.BLOCK_OUTER:
            start = slot * layout.page_bytes
            return pools[0].reshape(-1, layout.block_stride)[:, start : start + nbytes]
        case BlockPlacement.HEAD_OUTER:
            return pools[0].reshape(
                layout.num_blocks, nbytes // layout.head_bytes, layout.num_slots, layout.head_bytes
            )[:, :, slot, :]


def _unit_shape(layout: RankLayout, content: Any) -> Any:
    """Unit rows shaped as :func:`_unit_pages` views them (per head under head-outer placement)."""
    if layout.placement is BlockPlacement.HEAD_OUTER:
        return content.reshape(content.shape[0], -1, layout.head_bytes)
    return content


def apply_plan(plan: TransferPlan, src_pools: Sequence[np.ndarray], dst_pools: Sequence[np.ndarray]) -> None:
    """Copy every run of ``plan`` from the source pools into the destination pools (a local transport)."""
    for sr, so, dr, do, n in zip(
        plan.src_region.tolist(),
        plan.src_offset.tolist(),
        plan.dst_region.tolist(),
        plan.dst_offset.tolist(),
        plan.length.tolist(),
        strict=True,
    ):
        dst_pools[dr][do : do + n] = src_pools[sr][so : so + n]
