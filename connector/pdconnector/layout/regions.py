"""The memory one TP rank registers for transfer, laid out as vLLM's hybrid allocator (HMA) does.

HMA cuts the KV-holding layers into groups of equal size (``group_size``): each group is
one kind (attention or SSM) with its own block table; group ``j`` of a kind takes that
kind's layers ``j, j + n, j + 2n, ...`` (``n`` groups of that kind). vLLM 0.32 allocates one
buffer and lays every group out layer-outer from byte 0, so layer slot ``i`` of every group
aliases the same ``num_blocks * page`` bytes: one *region* per slot, holding pages of
attention and SSM layers alike (a block id belongs to exactly one group at a time). All
pages are the same size: the SSM page (conv + temporal state) is padded up to the
attention page of one logical block. Block-outermost layouts (``BLHNC``) are not modelled.

Inside a region, block ``b`` occupies ``[b * page_bytes, (b + 1) * page_bytes)``. The
attention view splits it into ``physical_blocks_per_logical`` kernel blocks; the SSM view
reads the conv sub-projections and the temporal state at the page start, the rest is padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pdconnector.layout.model import LayerKind, ModelSpec, Segment


@dataclass(frozen=True)
class Region:
    """One registered tensor: ``num_blocks`` pages of ``page_bytes`` (the block stride)."""

    index: int
    num_blocks: int
    page_bytes: int

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.page_bytes


@dataclass(frozen=True)
class KVGroup:
    """One HMA KV cache group: its layer kind, model layer indices and the regions they live in."""

    index: int
    kind: LayerKind
    layers: tuple[int, ...]

    @property
    def regions(self) -> tuple[int, ...]:
        """Layer ``i`` of the group lives in region ``i``."""
        return tuple(range(len(self.layers)))


@dataclass(frozen=True)
class PageSchema:
    """Segments of one page as a rank holds them: local byte offset and size, and the global
    (unsharded) size of each, in page order. Offsets are relative to the page start."""

    offsets: np.ndarray
    sizes: np.ndarray
    global_sizes: np.ndarray

    @classmethod
    def of(cls, segments: tuple[Segment, ...], tp_size: int) -> PageSchema:
        units = np.array([s.units for s in segments], dtype=np.int64)
        unit_bytes = np.array([s.unit_bytes for s in segments], dtype=np.int64)
        sizes = units // tp_size * unit_bytes
        offsets = np.cumsum(sizes) - sizes
        return cls(offsets, sizes, units * unit_bytes)

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

    model: ModelSpec
    tp_size: int
    tp_rank: int
    num_blocks: int

    def __post_init__(self) -> None:
        if self.tp_size <= 0 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"RankLayout: tp_rank {self.tp_rank} must lie in [0, tp_size={self.tp_size})")
        if self.num_blocks <= 0:
            raise ValueError(f"RankLayout.num_blocks must be positive, got {self.num_blocks}")
        for name, units in self._shard_units().items():
            if units % self.tp_size:
                raise ValueError(f"RankLayout: {name} ({units}) is not divisible by tp_size {self.tp_size}")
        if self.model.num_attention_layers and self.ssm_state_bytes > self.attention_page_bytes:
            raise ValueError(
                f"RankLayout: block_size {self.model.block_size} gives an attention page of {self.attention_page_bytes} B, "
                f"smaller than the SSM state of {self.ssm_state_bytes} B; vLLM would raise the block size (see hybrid_block_size)"
            )

    def _shard_units(self) -> dict[str, int]:
        units: dict[str, int] = {}
        if self.model.num_attention_layers:
            assert self.model.attention is not None
            units["attention num_kv_heads"] = self.model.attention.num_kv_heads
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

    @property
    def physical_page_bytes(self) -> int:
        """One kernel block of one attention layer."""
        return self.attention_schema.nbytes

    @property
    def attention_page_bytes(self) -> int:
        """One logical block of one attention layer."""
        return self.physical_page_bytes * self.model.physical_blocks_per_logical

    @property
    def ssm_conv_bytes(self) -> int:
        return int(self.ssm_schema.sizes[:-1].sum()) if self.model.ssm else 0

    @property
    def ssm_state_bytes(self) -> int:
        """Real SSM bytes per block: conv state + temporal state, no padding."""
        return self.ssm_schema.nbytes

    @property
    def page_bytes(self) -> int:
        """The common page (block stride) of every region."""
        return self.attention_page_bytes if self.model.num_attention_layers else self.ssm_state_bytes

    @property
    def ssm_padding_bytes(self) -> int:
        """Bytes per SSM page that HMA adds to equalise page sizes (never transferred)."""
        return self.page_bytes - self.ssm_state_bytes if self.model.num_ssm_layers else 0

    @cached_property
    def regions(self) -> tuple[Region, ...]:
        num_regions = max(len(g.layers) for g in self.groups)
        return tuple(Region(i, self.num_blocks, self.page_bytes) for i in range(num_regions))

    @cached_property
    def layer_regions(self) -> dict[int, int]:
        """Region of each KV-holding layer (an index into ``ModelSpec.layers``): what the vLLM side
        needs to map its per-layer cache tensors (those sharing one tensor share a region)."""
        return {layer: region for g in self.groups for region, layer in enumerate(g.layers)}

    @property
    def region_nbytes(self) -> tuple[int, ...]:
        return tuple(r.nbytes for r in self.regions)
