"""The descriptor-id view: every descriptor one side of a (prefill rank, decode rank) pair can
prepare once (NIXL ``prep_xfer_dlist``), and the ids a request uses (``make_prepped_xfer``).

Ids follow upstream vLLM's region-major formulas, generalised to several runs per unit:
attention ``desc = (region * Q_a + q) * N_phys + block`` and, after all attention descriptors,
SSM ``desc = num_attention + (region * Q_s + q) * N_logical + block``, where ``q`` is the run
inside a unit (for SSM: x, B, C, temporal state; for same-TP attention: the whole block, so
``Q_a = 1`` and the formula is upstream's ``region * N_phys + block``). This is the
alternative to :class:`TransferPlan`'s merged descriptors: no per-request descriptor lists,
but one descriptor per run per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdconnector.layout.model import LayerKind
from pdconnector.layout.plan import check_compatible, group_transfers, region_descriptors, shard_pieces
from pdconnector.layout.regions import BlockPlacement, RankLayout


@dataclass(frozen=True)
class DescriptorTable:
    """All descriptors of one side, in id order; offsets relative to each region's start."""

    region: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    num_attention_descs: int

    def __len__(self) -> int:
        return int(self.length.size)

    def to_descriptors(self, region_addrs: Sequence[int], *, device_id: int = 0) -> np.ndarray:
        """``(M, 3)`` int64 ``[addr, length, device_id]`` for NIXL ``get_xfer_descs`` /
        ``prep_xfer_dlist``."""
        expected = int(self.region.max(initial=-1)) + 1
        if len(region_addrs) != expected:
            raise ValueError(f"region_addrs: expected {expected} addresses, got {len(region_addrs)}")
        return region_descriptors(
            self.region, self.offset, self.length, region_addrs, device_id=device_id, name="region_addrs"
        )


def descriptor_tables(src: RankLayout, dst: RankLayout) -> tuple[DescriptorTable, DescriptorTable]:
    """The (source, destination) tables of the pair; entry ``i`` of one matches entry ``i`` of the other."""
    _check_layer_outer(src, dst)
    attention = shard_pieces(src.attention_schema, src.tp_rank, dst.attention_schema, dst.tp_rank)
    ssm = shard_pieces(src.ssm_schema, src.tp_rank, dst.ssm_schema, dst.tp_rank)
    tables = []
    for side, layout in enumerate((src, dst)):
        views = [
            _table(
                len(layout.regions),
                layout.num_blocks * layout.model.physical_blocks_per_logical,
                layout.physical_page_bytes,
                attention,
                side,
            ),
            _table(len(layout.regions), layout.num_blocks, layout.page_bytes, ssm, side)
            if layout.model.num_ssm_layers
            else _empty(),
        ]
        tables.append(
            DescriptorTable(
                *(np.concatenate([v[i] for v in views]) for i in range(3)),
                num_attention_descs=views[0][2].size,
            )
        )
    return tables[0], tables[1]


def descriptor_ids(
    src: RankLayout,
    dst: RankLayout,
    src_blocks: Sequence[Sequence[int]],
    dst_blocks: Sequence[Sequence[int]],
    *,
    num_tokens: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Ids into :func:`descriptor_tables` for one request, in :func:`plan_transfer`'s unmerged order."""
    _check_layer_outer(src, dst)
    bases = _attention_desc_counts(src, dst)
    src_ids, dst_ids = [], []
    for t in group_transfers(src, dst, src_blocks, dst_blocks, num_tokens=num_tokens):
        q = t.pieces[2].size
        for side, units, layout in ((0, t.src_units, src), (1, t.dst_units, dst)):
            per_region = layout.num_blocks * (
                layout.model.physical_blocks_per_logical if t.kind is LayerKind.ATTENTION else 1
            )
            base = 0 if t.kind is LayerKind.ATTENTION else bases[side]
            ids = (
                base
                + (t.slots[:, None, None] * q + np.arange(q)[None, None, :]) * per_region
                + units[None, :, None]
            )
            (src_ids if side == 0 else dst_ids).append(ids.ravel())
    return _cat(src_ids), _cat(dst_ids)


def _check_layer_outer(src: RankLayout, dst: RankLayout) -> None:
    check_compatible(src, dst)
    for side, layout in (("prefill", src), ("decode", dst)):
        if layout.placement is not BlockPlacement.LAYER_OUTER:
            raise ValueError(
                f"{side}: prepared descriptor tables follow upstream's layer-outer ids, not "
                f"{layout.placement} (plan_transfer moves every placement)"
            )


def _attention_desc_counts(src: RankLayout, dst: RankLayout) -> tuple[int, int]:
    q = shard_pieces(src.attention_schema, src.tp_rank, dst.attention_schema, dst.tp_rank)[2].size
    src_count, dst_count = (
        len(lay.regions) * q * lay.num_blocks * lay.model.physical_blocks_per_logical for lay in (src, dst)
    )
    return src_count, dst_count


def _table(
    num_regions: int, units: int, stride: int, pieces: tuple[np.ndarray, np.ndarray, np.ndarray], side: int
) -> tuple[np.ndarray, ...]:
    offsets, lengths = pieces[side], pieces[2]
    shape = (num_regions, lengths.size, units)
    region = np.broadcast_to(np.arange(num_regions, dtype=np.int32)[:, None, None], shape).ravel()
    offset = np.broadcast_to(
        offsets[None, :, None] + np.arange(units, dtype=np.int64)[None, None, :] * stride, shape
    ).ravel()
    length = np.broadcast_to(lengths[None, :, None], shape).ravel()
    return region, offset, length


def _empty() -> tuple[np.ndarray, ...]:
    return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, dtype=np.int64)
