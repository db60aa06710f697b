"""The memory one TP rank registers for transfer, laid out as vLLM's hybrid allocator (HMA) does.

HMA cuts the KV-holding layers into groups of equal size (``group_size``): each group is
one kind (attention or SSM) with its own block table; group ``j`` of a kind takes that
kind's layers ``j, j + n, j + 2n, ...`` (``n`` groups of that kind). vLLM 0.32 allocates one
buffer and lays every group out layer-outer from byte 0, so layer slot ``i`` of every group
aliases the same ``num_blocks * page`` bytes: one *region* per slot, holding pages of
attention and SSM layers alike (a block id belongs to exactly one group at a time). All
pages are the same size: the SSM page (conv + temporal state) is padded up to the
attention page of one logical block.

Where a block's pages sit is the rank's :class:`BlockPlacement`. Layer-outer (vLLM's
``LBHNC``/``LBNHC``): inside region ``i``, block ``b`` occupies ``[b * page_bytes, (b + 1) * page_bytes)``,
so a request's blocks cost one descriptor per layer per block. Block-outer (``BLHNC``/``BLNHC``):
one region, block ``b`` holds slot ``i``'s page at ``b * block_stride + i * page_bytes``, so a
block's state for every layer is one run. Head-outer (``BHLNC``, attention only): one region, block
``b`` holds KV head ``h`` of every slot as one run, so a heterogeneous-TP head slice stays one run.
The attention view splits a page into ``physical_blocks_per_logical`` kernel blocks (layer-outer only:
vLLM never splits a block that other layers' pages sit inside); the SSM view reads the conv
sub-projections and the temporal state at the page start, the rest is padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property

import numpy as np

from pdconnector.layout.model import AttentionLayout, KVModel, LayerKind, Segment, kv_heads_per_rank


class BlockPlacement(StrEnum):
    """Where the pages of one block sit in a rank's registered memory (vLLM's ``KVCacheLayout`` outer
    axes)."""

    LAYER_OUTER = "layer_outer"  # LBHNC, LBNHC: one region per layer slot
    BLOCK_OUTER = "block_outer"  # BLHNC, BLNHC: one region, a block holds every slot's page
    HEAD_OUTER = "head_outer"  # BHLNC: one region, a block holds each KV head of every slot as one run


@dataclass(frozen=True)
class Region:
    """One registered tensor: ``num_blocks`` blocks of ``block_stride`` bytes."""

    index: int
    num_blocks: int
    block_stride: int

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_stride


@dataclass(frozen=True)
class KVGroup:
    """One HMA KV cache group: its layer kind, model layer indices and the layer slots they live in."""

    index: int
    kind: LayerKind
    layers: tuple[int, ...]

    @property
    def slots(self) -> tuple[int, ...]:
        """Layer ``i`` of the group lives in slot ``i``."""
        return tuple(range(len(self.layers)))


@dataclass(frozen=True)
class PageSchema:
    """Segments of one page as a rank holds them: local byte offset and size, the global (unsharded) size of
    each, in page order, and how many ranks hold the same bytes of each (``replicas``: above 1 when TP exceeds
    the segment's units, as vLLM replicates KV heads once TP exceeds their count; each rank then holds one
    unit). Offsets are relative to the page start."""

    offsets: np.ndarray
    sizes: np.ndarray
    global_sizes: np.ndarray
    replicas: np.ndarray

    @classmethod
    def of(cls, segments: tuple[Segment, ...], tp_size: int) -> PageSchema:
        units = np.array([s.units for s in segments], dtype=np.int64)
        unit_bytes = np.array([s.unit_bytes for s in segments], dtype=np.int64)
        replicas = np.maximum(1, tp_size // np.maximum(units, 1))
        sizes = np.maximum(1, units // tp_size) * unit_bytes
        offsets = np.cumsum(sizes) - sizes
        return cls(offsets, sizes, units * unit_bytes, replicas)

    def starts(self, rank: int) -> np.ndarray:
        """Where rank ``rank``'s bytes of each segment start in the global segment."""
        return rank // self.replicas * self.sizes

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())


def group_layers(layers: tuple[LayerKind, ...]) -> tuple[KVGroup, ...]:
    """vLLM's HMA grouping: kinds in order of first appearance, each cut into groups of
    ``group_size`` (the smallest layer count, or the largest when they are within 1.5x)."""
    by_kind: dict[LayerKind, list[int]] = {}
    for index, kind in enumerate(layers):
        by_kind.setdefault(kind, []).append(index)
    counts = [len(v) for v in by_kind.values()]
    group_size = max(counts) if max(counts) < min(counts) * 1.5 else min(counts)
    groups: list[KVGroup] = []
    for kind, indices in by_kind.items():
        num_groups = -(-len(indices) // group_size)
        groups.extend(KVGroup(len(groups), kind, tuple(indices[j::num_groups])) for j in range(num_groups))
    return tuple(groups)


@dataclass(frozen=True)
class RankLayout:
    """Registered regions and page geometry of TP rank ``tp_rank`` of a TP-``tp_size`` engine."""

    model: KVModel
    tp_size: int
    tp_rank: int
    num_blocks: int
    placement: BlockPlacement = BlockPlacement.LAYER_OUTER

    def __post_init__(self) -> None:
        if self.tp_size <= 0 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"RankLayout: tp_rank {self.tp_rank} must lie in [0, tp_size={self.tp_size})")
        if self.num_blocks <= 0:
            raise ValueError(f"RankLayout.num_blocks must be positive, got {self.num_blocks}")
        self._check_placement()
        for name, units in self._shard_units().items():
            if units % self.tp_size:
                raise ValueError(f"RankLayout: {name} ({units}) is not divisible by tp_size {self.tp_size}")
        if (heads := self._kv_heads()) and heads < self.tp_size and self.tp_size % heads:
            raise ValueError(
                f"RankLayout: tp_size {self.tp_size} is above the attention num_kv_heads ({heads}) and not a "
                "multiple of it, so ranks cannot replicate whole heads"
            )
        if self.model.num_attention_layers and self.ssm_state_bytes > self.attention_page_bytes:
            raise ValueError(
                f"RankLayout: block_size {self.model.block_size} gives an attention page of "
                f"{self.attention_page_bytes} B, "
                f"smaller than the SSM state of {self.ssm_state_bytes} B; vLLM would raise the block size "
                "(see hybrid_block_size)"
            )

    def _check_placement(self) -> None:
        model = self.model
        if self.placement is not BlockPlacement.LAYER_OUTER and model.physical_blocks_per_logical != 1:
            raise ValueError(
                f"RankLayout: {self.placement} blocks hold other layers' pages, so vLLM never splits them "
                "into kernel blocks; "
                f"kernel_block_size {model.kernel_block_size} != block_size {model.block_size}"
            )
        if self.placement is BlockPlacement.HEAD_OUTER:
            if model.num_ssm_layers:
                raise ValueError(
                    "RankLayout: head_outer (BHLNC) places attention heads only; a model with SSM layers "
                    "needs block_outer (BLHNC)"
                )
            if model.attention is not None and model.attention.layout is not AttentionLayout.PACKED_HND:
                raise ValueError(
                    "RankLayout: head_outer (BHLNC) pages are head-major; attention layout "
                    f"{model.attention.layout} is not"
                )

    def _kv_heads(self) -> int:
        """The model's KV heads (0 without attention layers)."""
        attention = self.model.attention
        return attention.num_kv_heads if attention is not None and self.model.num_attention_layers else 0

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads this rank holds: its share, or one replicated head once TP exceeds the head count."""
        return kv_heads_per_rank(self._kv_heads(), self.tp_size) if self._kv_heads() else 0

    def _shard_units(self) -> dict[str, int]:
        """Counts TP must divide, by name: the SSM's (KV heads may instead be replicated, checked apart)."""
        units: dict[str, int] = {}
        if (heads := self._kv_heads()) >= self.tp_size:
            units["attention num_kv_heads"] = heads
        if self.model.num_ssm_layers:
            assert self.model.ssm is not None
            units.update({f"{self.model.ssm.family} {k}": v for k, v in self.model.ssm.shard_units.items()})
        return units

    @cached_property
    def groups(self) -> tuple[KVGroup, ...]:
        return group_layers(self.model.layers)

    @cached_property
    def attention_schema(self) -> PageSchema:
        """Segments of one physical (kernel) attention block."""
        if self.model.attention is None:
            return PageSchema.of((), self.tp_size)
        return PageSchema.of(self.model.attention.segments(self.model.kernel_block_size), self.tp_size)

    @cached_property
    def ssm_schema(self) -> PageSchema:
        """Segments of one logical SSM block: conv sub-projections, then the temporal state."""
        if self.model.ssm is None:
            return PageSchema.of((), self.tp_size)
        return PageSchema.of(self.model.ssm.segments, self.tp_size)

    @cached_property
    def physical_page_bytes(self) -> int:
        """One kernel block of one attention layer."""
        return self.attention_schema.nbytes

    @cached_property
    def attention_page_bytes(self) -> int:
        """One logical block of one attention layer."""
        return self.physical_page_bytes * self.model.physical_blocks_per_logical

    @property
    def ssm_conv_bytes(self) -> int:
        return int(self.ssm_schema.sizes[:-1].sum()) if self.model.ssm else 0

    @cached_property
    def ssm_state_bytes(self) -> int:
        """Real SSM bytes per block: conv state + temporal state, no padding."""
        return self.ssm_schema.nbytes

    @cached_property
    def page_bytes(self) -> int:
        """The common page (block stride) of every region."""
        return self.attention_page_bytes if self.model.num_attention_layers else self.ssm_state_bytes

    @property
    def ssm_padding_bytes(self) -> int:
        """Bytes per SSM page that HMA adds to equalise page sizes (never transferred)."""
        return self.page_bytes - self.ssm_state_bytes if self.model.num_ssm_layers else 0

    @cached_property
    def num_slots(self) -> int:
        """Layer slots: the largest group's layer count (slot ``i`` holds layer ``i`` of every group)."""
        return max(len(g.layers) for g in self.groups)

    @cached_property
    def block_stride(self) -> int:
        """Bytes from one block to the next inside a region."""
        return (
            self.page_bytes
            if self.placement is BlockPlacement.LAYER_OUTER
            else self.num_slots * self.page_bytes
        )

    @cached_property
    def regions(self) -> tuple[Region, ...]:
        num_regions = self.num_slots if self.placement is BlockPlacement.LAYER_OUTER else 1
        return tuple(Region(i, self.num_blocks, self.block_stride) for i in range(num_regions))

    @cached_property
    def layer_slots(self) -> dict[int, int]:
        """Slot of each KV-holding layer (an index into ``KVModel.layers``): layers of one slot alias the same
        bytes."""
        return {layer: slot for g in self.groups for slot, layer in enumerate(g.layers)}

    @cached_property
    def head_bytes(self) -> int:
        """One KV head of one attention page of this rank (head-outer blocks are runs of these)."""
        if self.model.attention is None:
            return 0
        return int(self.attention_schema.sizes[0]) // self.kv_heads_per_rank

    def locate(
        self, kind: LayerKind, slots: np.ndarray, units: np.ndarray, offsets: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(region, byte offset) of page offset ``offsets[q]`` of unit ``units[u]`` (a kernel block for
        attention, a logical block for SSM) of slot ``slots[r]``, broadcast to shape ``(R, U, Q)``. Under
        head-outer placement an offset must be the start of a run that stays inside one head."""
        s, u, q = (
            slots.astype(np.int64)[:, None, None],
            units.astype(np.int64)[None, :, None],
            offsets.astype(np.int64)[None, None, :],
        )
        shape = (s.shape[0], u.shape[1], q.shape[2])
        match self.placement:
            case BlockPlacement.LAYER_OUTER:
                stride = self.physical_page_bytes if kind is LayerKind.ATTENTION else self.page_bytes
                return np.broadcast_to(s, shape), np.broadcast_to(u * stride + q, shape)
            case BlockPlacement.BLOCK_OUTER:
                offset = u * self.block_stride + s * self.page_bytes + q
            case BlockPlacement.HEAD_OUTER:
                head, within = q // self.head_bytes, q % self.head_bytes
                offset = u * self.block_stride + (head * self.num_slots + s) * self.head_bytes + within
        return np.zeros(shape, dtype=np.int64), np.broadcast_to(offset, shape)

    @property
    def region_nbytes(self) -> tuple[int, ...]:
        return tuple(r.nbytes for r in self.regions)
