"""The staged path for fragmented transfers, and the cost model that chooses it per request.

A request whose blocks are scattered costs one descriptor per contiguous run, and each descriptor costs a
few microseconds to post before bandwidth matters (``reference/gpu-measurements.md``: ~7 us on an H200 over
UCX, so 65,536 runs take half a second). The staged path trades that for device copies: the source gathers
the runs into a slot of its staging buffer, one WRITE moves the slot into a slot the destination offered, and
the destination scatters it into its blocks (``pdconnector.worker.staging`` runs it).

A slot holds the request's bytes in the destination's address order, so each side derives its indexed copy
alone: the source from its plan (:func:`gather_copy`), the destination from the plan of its own blocks
(:func:`received_plan`, :func:`scatter_copy`); no index crosses the wire. A copy is equal rows, the largest
size dividing every run and offset on its side. Pure: row indices and milliseconds, no memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from pdconnector.layout.plan import TransferPlan, plan_transfer, split_runs
from pdconnector.layout.regions import RankLayout


@dataclass(frozen=True)
class SlotCopy:
    """One side of a staged transfer as equal rows: row ``region_row[i]`` of region ``region[i]`` (rows of
    ``row_bytes`` from the region's start) is row ``slot_row[i]`` of the staging slot.

    The slot holds a request's bytes in the destination's address order (region, then offset), so the
    source's gather and the destination's scatter agree on it without exchanging an index: each side derives
    its own copy from the plan it can compute (:func:`gather_copy`, :func:`scatter_copy`)."""

    row_bytes: int
    region: np.ndarray
    region_row: np.ndarray
    slot_row: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.region.size) * self.row_bytes

    def by_region(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``(region, region rows, slot rows)`` per region touched, slot rows ascending within each."""
        order = np.lexsort((self.slot_row, self.region))
        region, region_row, slot_row = self.region[order], self.region_row[order], self.slot_row[order]
        bounds = np.flatnonzero(np.diff(region)) + 1
        return [
            (int(r[0]), rows, slots)
            for r, rows, slots in zip(
                np.split(region, bounds),
                np.split(region_row, bounds),
                np.split(slot_row, bounds),
                strict=True,
            )
            if r.size
        ]


def gather_copy(plan: TransferPlan) -> SlotCopy:
    """The source's copy of ``plan``: its runs into the slot, in the destination's address order."""
    return _slot_copy(plan, plan.src_region, plan.src_offset)


def scatter_copy(plan: TransferPlan) -> SlotCopy:
    """The destination's copy of ``plan``: the slot into its runs (any plan with the same destination bytes,
    such as :func:`received_plan`'s, gives the same copy)."""
    return _slot_copy(plan, plan.dst_region, plan.dst_offset)


def _slot_copy(plan: TransferPlan, region: np.ndarray, offset: np.ndarray) -> SlotCopy:
    order = np.lexsort((plan.dst_offset, plan.dst_region))
    region, offset, length = region[order], offset[order], plan.length[order]
    slot_offset = np.cumsum(length) - length
    if not length.size:
        return SlotCopy(1, region, offset, slot_offset)
    row = int(np.gcd.reduce(np.concatenate([offset, slot_offset, length])))
    region_starts, slot_starts = split_runs(length, row, offset, slot_offset)
    regions = np.repeat(region, length // row).astype(np.int32)
    return SlotCopy(row, regions, region_starts // row, slot_starts // row)


def received_plan(
    dst: RankLayout,
    prefill_tp_size: int,
    prefill_rank: int,
    dst_blocks: Sequence[Sequence[int]],
    *,
    num_tokens: int | None,
) -> TransferPlan:
    """What prefill rank ``prefill_rank`` of a TP-``prefill_tp_size`` engine writes into ``dst`` for a
    request in ``dst_blocks``, as far as the destination can tell without the source's block ids: the
    destination bytes are the same whichever source blocks hold them, so a stand-in source with the blocks in
    order plans them."""
    counts = [len(group) for group in dst_blocks]
    source = RankLayout(dst.model, prefill_tp_size, prefill_rank, max(1, *counts), dst.placement)
    src_blocks = [range(count) for count in counts]
    return plan_transfer(source, dst, src_blocks, dst_blocks, num_tokens=num_tokens)


class TransferPath(StrEnum):
    DIRECT = "direct"  # one descriptor per run, straight between the KV caches
    STAGED = "staged"  # gathered into a slot, one WRITE, scattered


@dataclass(frozen=True)
class PathCosts:
    """What moving a request costs on one link, as a linear model with four figures.

    Direct: ``descriptors * descriptor_us + nbytes / link_gbps``. Staged: ``staged_overhead_ms + nbytes /
    staged_gbps``, where ``staged_gbps`` is the rate of gather, WRITE and scatter one after the other and
    ``staged_overhead_ms`` what a staged request adds whatever its size (index upload, copy launches, the
    synchronisations). The defaults are fitted to one H200, two processes, NIXL 1.5.1 over UCX cuda_ipc
    (``docs/benchmarks.md``, 2026-12-02 second table): 7.7 us per descriptor (65,536 in 534 ms, 1,024 in 6.3
    ms), a contiguous 512 MiB WRITE in 0.37 ms, and block-outer requests staged in 0.98, 1.29 and 2.76 ms for
    32, 128 and 512 MiB (1.18, 1.62, 3.57 ms for 40, 160 and 640 MiB).
    """

    descriptor_us: float = 7.7
    link_gbps: float = 1345.0
    staged_overhead_ms: float = 0.9
    staged_gbps: float = 275.0

    def __post_init__(self) -> None:
        for name in ("descriptor_us", "link_gbps", "staged_overhead_ms", "staged_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PathCosts.{name} must be positive, got {getattr(self, name)!r}")

    def direct_ms(self, descriptors: int, nbytes: int) -> float:
        return descriptors * self.descriptor_us / 1e3 + nbytes / (self.link_gbps * 1e6)

    def staged_ms(self, nbytes: int) -> float:
        return self.staged_overhead_ms + nbytes / (self.staged_gbps * 1e6)


@dataclass(frozen=True)
class PathChoice:
    path: TransferPath
    direct_ms: float
    staged_ms: float


def choose_path(descriptors: int, nbytes: int, slot_bytes: int, costs: PathCosts) -> PathChoice:
    """The cheaper path for a request of ``descriptors`` runs and ``nbytes`` given a staging slot of
    ``slot_bytes`` (0: none; a request larger than the slot goes direct); a tie goes to the direct path, which
    needs no copies."""
    direct = costs.direct_ms(descriptors, nbytes)
    if not 0 < nbytes <= slot_bytes:
        return PathChoice(TransferPath.DIRECT, direct, math.inf)
    staged = costs.staged_ms(nbytes)
    return PathChoice(TransferPath.STAGED if staged < direct else TransferPath.DIRECT, direct, staged)


def staging_cost_blocks(staging_bytes: int, layout: RankLayout) -> int:
    """KV blocks a rank's staging buffer takes from its cache: one block is every layer slot's page."""
    if staging_bytes < 0:
        raise ValueError(f"staging_bytes must not be negative, got {staging_bytes}")
    return -(-staging_bytes // (layout.num_slots * layout.page_bytes))
