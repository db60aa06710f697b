"""The staged path for fragmented transfers, and the cost model that chooses it per request.

A request whose blocks are scattered costs one descriptor per contiguous run, and each descriptor costs a
few microseconds to post before bandwidth matters (``reference/gpu-measurements.md``: ~7 us on an H200 over
UCX, so 65,536 runs take half a second). The staged path trades that for device copies: the source gathers
the runs into a staging buffer, one WRITE per chunk moves the buffer into the peer's staging buffer, and the
peer scatters it into its blocks. Two chunk slots per side let chunk ``k + 1`` be gathered while chunk ``k``
is on the wire.

:func:`stage` turns a :class:`~pdconnector.layout.plan.TransferPlan` into equal rows: the largest size that
divides every offset and length on both sides, so a gather or scatter is one indexed copy of rows. Rows keep
the plan's order on both sides; chunk ``k`` is rows ``[k * r, (k + 1) * r)`` with ``r = chunk_bytes //
row_bytes``. Pure: row indices and milliseconds, no memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from pdconnector.layout.plan import TransferPlan, split_runs
from pdconnector.layout.regions import RankLayout


@dataclass(frozen=True)
class StagedPlan:
    """A plan as rows of ``row_bytes``: ``src_rows[i]`` of the source buffer goes to ``dst_rows[i]`` of the
    destination buffer (row indices from each side's base address), ``rows_per_chunk`` rows at a time."""

    row_bytes: int
    src_rows: np.ndarray
    dst_rows: np.ndarray
    rows_per_chunk: int

    @property
    def nbytes(self) -> int:
        return int(self.src_rows.size) * self.row_bytes

    @property
    def num_chunks(self) -> int:
        return -(-int(self.src_rows.size) // self.rows_per_chunk)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of a full chunk: what one staging slot holds."""
        return self.rows_per_chunk * self.row_bytes

    def chunk(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Source and destination rows of chunk ``k``, in staging order."""
        if not 0 <= k < self.num_chunks:
            raise IndexError(f"chunk {k} of a staged plan of {self.num_chunks} chunks")
        rows = slice(k * self.rows_per_chunk, (k + 1) * self.rows_per_chunk)
        return self.src_rows[rows], self.dst_rows[rows]


def stage(
    plan: TransferPlan,
    src_addrs: Sequence[int],
    src_base: int,
    dst_addrs: Sequence[int],
    dst_base: int,
    *,
    chunk_bytes: int,
) -> StagedPlan:
    """``plan`` as rows, given each side's region addresses and the base its rows count from (the start of the
    buffer the regions lie in), in chunks of at most ``chunk_bytes``."""
    src_offset = plan.src_offset + np.asarray(src_addrs, dtype=np.int64)[plan.src_region] - src_base
    dst_offset = plan.dst_offset + np.asarray(dst_addrs, dtype=np.int64)[plan.dst_region] - dst_base
    if (src_offset < 0).any() or (dst_offset < 0).any():
        raise ValueError("stage: a run starts before its side's base address")
    if not len(plan):
        return StagedPlan(1, src_offset, dst_offset, max(1, chunk_bytes))
    row = int(np.gcd.reduce(np.concatenate([src_offset, dst_offset, plan.length])))
    if chunk_bytes < row:
        raise ValueError(f"chunk_bytes {chunk_bytes} is smaller than one row of this plan ({row} B)")
    src_starts, dst_starts = split_runs(plan.length, row, src_offset, dst_offset)
    return StagedPlan(row, src_starts // row, dst_starts // row, chunk_bytes // row)


class TransferPath(StrEnum):
    DIRECT = "direct"  # one descriptor per run, straight between the KV caches
    STAGED = "staged"  # gathered, moved in chunks, scattered


@dataclass(frozen=True)
class PathCosts:
    """What moving a request costs on one link, as a linear model with four figures.

    Direct: ``descriptors * descriptor_us + nbytes / link_gbps``. Staged: ``chunks * chunk_ms +
    nbytes / staged_gbps``, where ``staged_gbps`` is the pipelined rate of gather, WRITE and scatter together
    and ``chunk_ms`` what each chunk adds (its synchronisation and notification round trip). The defaults are
    fitted to one H200, two processes, NIXL 1.5.1 over UCX cuda_ipc (``docs/benchmarks.md``, timed from the
    post): 7.7 us per descriptor (65,536 in 505 ms, 1,024 in 8.3 ms), a contiguous 512 MiB WRITE in 0.41 ms,
    and the staged 512 MiB request in 2.5, 2.8 and 7.2 ms with 512, 256 and 64 MiB chunks (least squares).
    """

    descriptor_us: float = 7.7
    link_gbps: float = 1345.0
    chunk_ms: float = 0.68
    staged_gbps: float = 325.0

    def __post_init__(self) -> None:
        for name in ("descriptor_us", "link_gbps", "chunk_ms", "staged_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PathCosts.{name} must be positive, got {getattr(self, name)!r}")

    def direct_ms(self, descriptors: int, nbytes: int) -> float:
        return descriptors * self.descriptor_us / 1e3 + nbytes / (self.link_gbps * 1e6)

    def staged_ms(self, nbytes: int, chunks: int) -> float:
        return chunks * self.chunk_ms + nbytes / (self.staged_gbps * 1e6)


@dataclass(frozen=True)
class PathChoice:
    path: TransferPath
    direct_ms: float
    staged_ms: float


def choose_path(descriptors: int, nbytes: int, chunk_bytes: int, costs: PathCosts) -> PathChoice:
    """The cheaper path for a request of ``descriptors`` runs and ``nbytes`` with staging chunks of
    ``chunk_bytes`` (0: no staging buffer); a tie goes to the direct path, which needs no copies."""
    direct = costs.direct_ms(descriptors, nbytes)
    if chunk_bytes <= 0 or nbytes == 0:
        return PathChoice(TransferPath.DIRECT, direct, math.inf)
    staged = costs.staged_ms(nbytes, -(-nbytes // chunk_bytes))
    return PathChoice(TransferPath.STAGED if staged < direct else TransferPath.DIRECT, direct, staged)


def staging_cost_blocks(staging_bytes: int, layout: RankLayout) -> int:
    """KV blocks a rank's staging buffer takes from its cache: one block is every layer slot's page."""
    if staging_bytes < 0:
        raise ValueError(f"staging_bytes must not be negative, got {staging_bytes}")
    return -(-staging_bytes // (layout.num_slots * layout.page_bytes))
