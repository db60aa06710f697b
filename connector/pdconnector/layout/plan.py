"""Descriptor planning: which bytes of a prefill rank go where in a decode rank.

Two views over the same pages, attention first: attention groups move kernel (physical)
blocks, ``logical * ratio + k``; SSM groups move logical blocks, each as one run per conv
sub-projection plus one for the temporal state, sized to the real bytes so the HMA padding
never crosses the wire.

Heterogeneous TP falls out of the segment model: a segment is sharded over a TP-``t`` engine
as ``t`` equal contiguous runs, so prefill rank ``p`` holds global bytes
``[p * s_p, (p + 1) * s_p)`` of it and decode rank ``d`` holds ``[d * s_d, (d + 1) * s_d)``;
their intersection is what ``p`` writes into ``d``. With ``D_TP > P_TP`` this is ``d``'s
slice of ``p``'s block (offset ``(d % ratio) * s_d`` inside the segment); with
``P_TP > D_TP`` it is chunk ``p % ratio`` of ``d``'s segment, filled by consecutive ranks. Above the KV head
count ranks replicate heads (rank ``r`` of TP ``t`` holds head ``r // (t / heads)``); of the writers holding a
replicated head only the first sends it.
Everything is numpy broadcasting over (region, block, piece); no Python loop per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdconnector.layout.model import LayerKind, SsmFamily
from pdconnector.layout.regions import BlockPlacement, PageSchema, RankLayout

_EMPTY_I32 = np.zeros(0, dtype=np.int32)
_EMPTY_I64 = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class TransferPlan:
    """Byte runs ``src_rank`` writes into ``dst_rank`` for one request.

    Offsets are relative to the start of each side's registered region (``RankLayout.regions``).
    ``naive_nbytes`` is what a whole-page transfer of the same blocks would move for this
    pair (HMA padding and unused token slots of the last logical block included).
    """

    src_rank: int
    dst_rank: int
    src_region: np.ndarray
    src_offset: np.ndarray
    dst_region: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray
    naive_nbytes: int

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def __len__(self) -> int:
        return int(self.length.shape[0])

    def merged(self) -> TransferPlan:
        """Adjacent runs that are contiguous on both sides fused into one descriptor."""
        if len(self) < 2:
            return self
        follows = (
            (self.src_region[1:] == self.src_region[:-1])
            & (self.dst_region[1:] == self.dst_region[:-1])
            & (self.src_offset[1:] == self.src_offset[:-1] + self.length[:-1])
            & (self.dst_offset[1:] == self.dst_offset[:-1] + self.length[:-1])
        )
        if not follows.any():
            return self
        starts = np.flatnonzero(np.concatenate(([True], ~follows)))
        return TransferPlan(
            self.src_rank,
            self.dst_rank,
            self.src_region[starts],
            self.src_offset[starts],
            self.dst_region[starts],
            self.dst_offset[starts],
            np.add.reduceat(self.length, starts),
            self.naive_nbytes,
        )

    def to_descriptors(
        self,
        src_region_addrs: Sequence[int],
        dst_region_addrs: Sequence[int],
        *,
        src_device_id: int = 0,
        dst_device_id: int = 0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Two ``(N, 3)`` int64 arrays ``[addr, length, device_id]`` for NIXL ``get_xfer_descs``.

        Each side names its own device: TP rank ``r`` of a GPU engine holds its pools on ``cuda:r``, and NIXL
        looks a descriptor up in the registrations of that device only."""
        src = region_descriptors(
            self.src_region,
            self.src_offset,
            self.length,
            src_region_addrs,
            device_id=src_device_id,
            name="src_region_addrs",
        )
        dst = region_descriptors(
            self.dst_region,
            self.dst_offset,
            self.length,
            dst_region_addrs,
            device_id=dst_device_id,
            name="dst_region_addrs",
        )
        return src, dst


def region_descriptors(
    region: np.ndarray,
    offset: np.ndarray,
    length: np.ndarray,
    addrs: Sequence[int],
    *,
    device_id: int,
    name: str,
) -> np.ndarray:
    """``[addr, length, device_id]`` rows from region-relative runs and the regions' base addresses."""
    base = np.asarray(addrs, dtype=np.int64)
    if region.size and int(region.max()) >= base.size:
        raise ValueError(f"{name}: uses region {int(region.max())} but only {base.size} addresses were given")
    if device_id < 0:
        raise ValueError(f"{name}: device id must be >= 0, got {device_id}")
    out = np.empty((length.size, 3), dtype=np.int64)
    out[:, 0] = base[region] + offset
    out[:, 1] = length
    out[:, 2] = device_id
    return out


def targets_for(prefill_rank: int, p_tp: int, d_tp: int) -> tuple[int, ...]:
    """Decode ranks that prefill rank ``prefill_rank`` writes into."""
    _check_tp_pair(p_tp, d_tp)
    if d_tp >= p_tp:
        ratio = d_tp // p_tp
        return tuple(range(prefill_rank * ratio, (prefill_rank + 1) * ratio))
    return (prefill_rank // (p_tp // d_tp),)


def writers_for(decode_rank: int, p_tp: int, d_tp: int) -> tuple[int, ...]:
    """Prefill ranks that write into decode rank ``decode_rank``."""
    _check_tp_pair(p_tp, d_tp)
    if p_tp >= d_tp:
        ratio = p_tp // d_tp
        return tuple(range(decode_rank * ratio, (decode_rank + 1) * ratio))
    return (decode_rank // (d_tp // p_tp),)


def expected_notifications(p_tp: int, d_tp: int) -> int:
    """Completion notifications one decode rank waits for (one per writing prefill rank)."""
    _check_tp_pair(p_tp, d_tp)
    return max(1, p_tp // d_tp)


def _check_tp_pair(p_tp: int, d_tp: int) -> None:
    if p_tp <= 0 or d_tp <= 0:
        raise ValueError(f"TP sizes must be positive, got prefill {p_tp}, decode {d_tp}")
    if max(p_tp, d_tp) % min(p_tp, d_tp):
        raise ValueError(
            f"unsupported TP pair: prefill TP {p_tp} and decode TP {d_tp} must divide one another"
        )


def check_compatible(src: RankLayout, dst: RankLayout) -> None:
    """Raise ``ValueError`` unless ``src`` can write into ``dst`` (same model state, supported TP pair)."""
    _check_tp_pair(src.tp_size, dst.tp_size)
    a, b = src.model, dst.model
    for name in ("layers", "attention", "ssm", "block_size", "kernel_block_size"):
        if getattr(a, name) != getattr(b, name):
            raise ValueError(
                f"prefill and decode models differ in {name}: {getattr(a, name)!r} != {getattr(b, name)!r}"
            )
    if (
        a.ssm is not None
        and a.ssm.family is SsmFamily.MAMBA1
        and src.tp_size != dst.tp_size
        and a.num_ssm_layers
    ):
        raise ValueError(
            f"mamba1 state transfer needs equal TP on both sides, got prefill TP {src.tp_size}, decode TP "
            f"{dst.tp_size}"
        )


@dataclass(frozen=True)
class GroupTransfer:
    """One KV group of a request in one view: which units move and which runs of each unit.

    A unit is a kernel block (attention view) or a logical block (SSM view) of one layer slot; ``pieces`` are
    (src page offset, dst page offset, length) inside a unit, cut so that each stays one run on both sides.
    """

    group: int
    kind: LayerKind
    slots: np.ndarray
    src_units: np.ndarray
    dst_units: np.ndarray
    pieces: tuple[np.ndarray, np.ndarray, np.ndarray]


def group_transfers(
    src: RankLayout,
    dst: RankLayout,
    src_blocks: Sequence[Sequence[int]],
    dst_blocks: Sequence[Sequence[int]],
    *,
    num_tokens: int | None = None,
) -> list[GroupTransfer]:
    """The request's groups in descriptor order (attention view first, then SSM), validated."""
    check_compatible(src, dst)
    src_ids, dst_ids = _validated_blocks(src, dst, src_blocks, dst_blocks)
    ratio = src.model.physical_blocks_per_logical
    writers = writers_for(dst.tp_rank, src.tp_size, dst.tp_size)
    # Only writers share bytes with a decode rank; with replicated KV heads others may hold the same ones.
    pairs = src.tp_rank in writers
    out: list[GroupTransfer] = []
    for kind in (LayerKind.ATTENTION, LayerKind.SSM):
        for group in (g for g in src.groups if g.kind is kind):
            s_ids, d_ids = src_ids[group.index], dst_ids[group.index]
            if kind is LayerKind.ATTENTION:
                s_ids, d_ids = _physical(s_ids, ratio), _physical(d_ids, ratio)
                if num_tokens is not None:
                    s_ids, d_ids = _trim_to_tokens(
                        s_ids, d_ids, num_tokens, src.model.kernel_block_size, group.index
                    )
                schemas = (src.attention_schema, dst.attention_schema)
            else:
                schemas = (src.ssm_schema, dst.ssm_schema)
            pieces = shard_pieces(
                schemas[0], src.tp_rank, schemas[1], dst.tp_rank, first_writer=src.tp_rank == writers[0]
            )
            if not pairs:
                pieces = tuple(piece[:0] for piece in pieces)
            if BlockPlacement.HEAD_OUTER in (src.placement, dst.placement):
                pieces = _per_head(pieces, src.head_bytes)
            out.append(
                GroupTransfer(
                    group.index, kind, np.asarray(group.slots, dtype=np.int32), s_ids, d_ids, pieces
                )
            )
    return out


def plan_transfer(
    src: RankLayout,
    dst: RankLayout,
    src_blocks: Sequence[Sequence[int]],
    dst_blocks: Sequence[Sequence[int]],
    *,
    num_tokens: int | None = None,
    merge: bool = True,
) -> TransferPlan:
    """Plan what prefill rank ``src`` writes into decode rank ``dst`` for one request.

    ``src_blocks`` / ``dst_blocks`` hold the logical block ids per KV group (vLLM's order,
    ``RankLayout.groups``); group ``g``'s ``i``-th source block goes to its ``i``-th
    destination block. With ``num_tokens``, attention moves only the kernel blocks that
    hold tokens, not the empty tail of the last logical block. A pair that shares no bytes
    (see :func:`targets_for`) gets an empty plan.
    """
    transfers = group_transfers(src, dst, src_blocks, dst_blocks, num_tokens=num_tokens)
    naive = 0
    if _writes_into(src, dst):
        naive_page = min(src.page_bytes, dst.page_bytes)
        naive = sum(len(src_blocks[t.group]) * t.slots.size * naive_page for t in transfers)
    plan = _concat(src.tp_rank, dst.tp_rank, [_broadcast(t, src, dst) for t in transfers], naive)
    return plan.merged() if merge else plan


def shard_pieces(
    src: PageSchema, src_rank: int, dst: PageSchema, dst_rank: int, *, first_writer: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of one page that ``src_rank`` holds and ``dst_rank`` needs: (src offset, dst offset, length).

    A replicated segment is held by several consecutive source ranks; of the writers of ``dst_rank`` (a
    contiguous range, ``first_writer`` says whether ``src_rank`` opens it) only the first holding it sends it,
    so every destination byte is written once."""
    src_start = src.starts(src_rank)
    dst_start = dst.starts(dst_rank)
    lo = np.maximum(src_start, dst_start)
    hi = np.minimum(src_start + src.sizes, dst_start + dst.sizes)
    keep = (hi > lo) & (first_writer | (src_rank % src.replicas == 0))
    return (
        (src.offsets + lo - src_start)[keep],
        (dst.offsets + lo - dst_start)[keep],
        (hi - lo)[keep],
    )


def _writes_into(src: RankLayout, dst: RankLayout) -> bool:
    return dst.tp_rank in targets_for(src.tp_rank, src.tp_size, dst.tp_size)


def _physical(logical: np.ndarray, ratio: int) -> np.ndarray:
    return (logical[:, None] * ratio + np.arange(ratio, dtype=np.int64)).ravel()


def _trim_to_tokens(
    s_ids: np.ndarray, d_ids: np.ndarray, num_tokens: int, kernel_block_size: int, group: int
) -> tuple[np.ndarray, np.ndarray]:
    needed = -(-num_tokens // kernel_block_size)
    if num_tokens < 0 or needed > s_ids.size:
        raise ValueError(
            f"num_tokens {num_tokens} does not fit the {s_ids.size} kernel blocks given for KV group {group}"
        )
    return s_ids[:needed], d_ids[:needed]


def split_runs(length: np.ndarray, unit: int, *starts: np.ndarray) -> tuple[np.ndarray, ...]:
    """Runs of ``length`` bytes (each a multiple of ``unit``) cut into ``unit``-byte pieces: the start of
    every piece, for each array of run starts given."""
    pieces = length // unit
    step = (
        np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    ) * unit
    return tuple(np.repeat(start, pieces) + step for start in starts)


def _per_head(
    pieces: tuple[np.ndarray, np.ndarray, np.ndarray], head_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces cut at KV head boundaries: a head-outer block keeps each head of a page in its own run. TP
    shards attention by whole heads, so every piece starts at a head boundary on both sides."""
    src, dst, length = pieces
    src, dst = split_runs(length, head_bytes, src, dst)
    return src, dst, np.full(src.size, head_bytes, dtype=np.int64)


# The (slot, unit, piece) axes in each placement's memory order: runs adjacent in this order can be contiguous
# on the source, so flattening in it lets :meth:`TransferPlan.merged` fuse a block's layers (block-outer) or
# heads (head-outer).
_MEMORY_ORDER = {
    BlockPlacement.LAYER_OUTER: (0, 1, 2),
    BlockPlacement.BLOCK_OUTER: (1, 0, 2),
    BlockPlacement.HEAD_OUTER: (1, 2, 0),
}


def _fused_slots(
    t: GroupTransfer, src: RankLayout, dst: RankLayout
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Slots and pieces with the slot axis folded into the pieces where both sides keep a unit's slots side by
    side: block-outer pages moved whole (equal TP), and head-outer heads of every slot. A 16k-token request
    then plans as one run per block instead of one per layer per block, which would cost milliseconds of numpy
    to merge back."""
    slots, (piece_src, piece_dst, piece_len) = t.slots, t.pieces
    if src.placement is not dst.placement or src.placement is BlockPlacement.LAYER_OUTER or slots.size < 2:
        return slots, t.pieces
    whole_pages = (
        piece_len.size == 1
        and int(piece_src[0]) == int(piece_dst[0]) == 0
        and int(piece_len[0]) == src.page_bytes == dst.page_bytes
    )
    # a head's run spans all slots of a head-outer block
    every_slot = slots.size == src.num_slots == dst.num_slots
    if (src.placement is BlockPlacement.BLOCK_OUTER and whole_pages) or (
        src.placement is BlockPlacement.HEAD_OUTER and every_slot
    ):
        return slots[:1], (piece_src, piece_dst, piece_len * slots.size)
    return slots, t.pieces


def _broadcast(t: GroupTransfer, src: RankLayout, dst: RankLayout) -> tuple[np.ndarray, ...]:
    """The (slot, unit, piece) grid of both sides, flattened in the source's memory order."""
    slots, (piece_src, piece_dst, piece_len) = _fused_slots(t, src, dst)
    src_region, src_offset = src.locate(t.kind, slots, t.src_units, piece_src)
    dst_region, dst_offset = dst.locate(t.kind, slots, t.dst_units, piece_dst)
    length = np.broadcast_to(piece_len[None, None, :], src_offset.shape)
    order = _MEMORY_ORDER[src.placement]
    return tuple(
        np.transpose(a, order).ravel() for a in (src_region, src_offset, dst_region, dst_offset, length)
    )


def _concat(src_rank: int, dst_rank: int, parts: list[tuple[np.ndarray, ...]], naive: int) -> TransferPlan:
    if not parts:
        return TransferPlan(
            src_rank, dst_rank, _EMPTY_I32, _EMPTY_I64, _EMPTY_I32, _EMPTY_I64, _EMPTY_I64, naive
        )
    cols = [np.concatenate([p[i] for p in parts]) for i in range(5)]
    return TransferPlan(
        src_rank,
        dst_rank,
        cols[0].astype(np.int32, copy=False),
        cols[1].astype(np.int64, copy=False),
        cols[2].astype(np.int32, copy=False),
        cols[3].astype(np.int64, copy=False),
        cols[4].astype(np.int64, copy=False),
        naive,
    )


def _validated_blocks(
    src: RankLayout, dst: RankLayout, src_blocks: Sequence[Sequence[int]], dst_blocks: Sequence[Sequence[int]]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    num_groups = len(src.groups)
    for side, blocks in (("src_blocks", src_blocks), ("dst_blocks", dst_blocks)):
        if len(blocks) != num_groups:
            raise ValueError(f"{side}: expected block ids for {num_groups} KV groups, got {len(blocks)}")
    src_ids = [_ids(b, src.num_blocks, f"src_blocks[{g}]") for g, b in enumerate(src_blocks)]
    dst_ids = [_ids(b, dst.num_blocks, f"dst_blocks[{g}]") for g, b in enumerate(dst_blocks)]
    for g, (s, d) in enumerate(zip(src_ids, dst_ids, strict=True)):
        if s.size != d.size:
            raise ValueError(f"KV group {g}: {s.size} source blocks but {d.size} destination blocks")
    # Every region is shared by all groups, so a destination block id may appear only once overall.
    # Sorted neighbours, not a count over the pool: the check costs the request's size, not the engine's.
    ordered = np.sort(np.concatenate(dst_ids) if dst_ids else _EMPTY_I64)
    repeats = ordered[1:][ordered[1:] == ordered[:-1]]
    if repeats.size:
        raise ValueError(f"dst_blocks: block id {int(repeats[0])} is requested more than once")
    return src_ids, dst_ids


def _ids(blocks: Sequence[int], num_blocks: int, name: str) -> np.ndarray:
    ids = np.asarray(blocks, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = int(ids[(ids < 0) | (ids >= num_blocks)][0])
        raise ValueError(f"{name}: block id {bad} out of range [0, {num_blocks})")
    return ids
