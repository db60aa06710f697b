"""Descriptor arrays and the registered-region table both transports check them against.

A descriptor array is ``(N, 3)`` int64, rows ``[addr, nbytes, device_id]`` (what the layout
planner produces and what NIXL's ``get_xfer_descs`` takes)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np

from pdconnector.transport.base import Device, MemoryRegion, TransportError

EMPTY_DESCRIPTORS = np.zeros((0, 3), dtype=np.int64)


def as_descriptors(descriptors: np.ndarray, field: str) -> np.ndarray:
    """Validate the shape and values of one side's descriptors; returns them as C-contiguous int64."""
    array = np.asarray(descriptors)
    if array.ndim != 2 or array.shape[1] != 3:
        raise TransportError(
            f"{field}: descriptors must have shape (N, 3) [addr, nbytes, device_id], got {array.shape}"
        )
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TransportError(f"{field}: descriptors must be integers, got dtype {array.dtype}")
    array = np.ascontiguousarray(array, dtype=np.int64)
    if (array < 0).any():
        row = int(np.argwhere(array < 0)[0, 0])
        raise TransportError(f"{field}: descriptor {row} has a negative field: {array[row].tolist()}")
    return array


def pair_descriptors(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both sides of one transfer, validated against each other, zero-length rows dropped
    (they move nothing and NIXL and the mock need not see them)."""
    local, remote = as_descriptors(local, "local"), as_descriptors(remote, "remote")
    if local.shape[0] != remote.shape[0]:
        raise TransportError(f"local has {local.shape[0]} descriptors but remote has {remote.shape[0]}")
    mismatch = np.flatnonzero(local[:, 1] != remote[:, 1])
    if mismatch.size:
        row = int(mismatch[0])
        raise TransportError(
            f"descriptor {row}: local length {local[row, 1]} != remote length {remote[row, 1]}"
        )
    moving = local[:, 1] > 0
    if not moving.all():
        local, remote = local[moving], remote[moving]
    return local, remote


class RegionTable:
    """Non-overlapping registered regions of one agent, with a vectorised containment check."""

    def __init__(self, regions: Iterable[MemoryRegion] = ()) -> None:
        self._regions: list[MemoryRegion] = []
        self.add(list(regions))

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        return tuple(self._regions)

    @property
    def device(self) -> Device | None:
        return self._regions[0].device if self._regions else None

    def add(self, regions: Sequence[MemoryRegion]) -> None:
        """Add regions; rejects mixed device kinds and overlaps (a double registration is a bug)."""
        merged = [*self._regions, *regions]
        if len({r.device for r in merged}) > 1:
            raise TransportError(
                "all regions of one agent must share one device kind, got "
                f"{sorted({r.device.value for r in merged})}"
            )
        ordered = sorted(merged, key=lambda r: (r.device_id, r.addr))
        for before, after in itertools.pairwise(ordered):
            if before.device_id == after.device_id and after.addr < before.addr + before.nbytes:
                raise TransportError(
                    f"region at {after.addr:#x} (+{after.nbytes}) overlaps region at {before.addr:#x} "
                    f"(+{before.nbytes})"
                )
        self._regions = ordered

    def first_outside(self, descriptors: np.ndarray) -> int | None:
        """Index of the first descriptor not wholly inside one region of its device, or None."""
        if descriptors.shape[0] == 0:
            return None
        inside = np.zeros(descriptors.shape[0], dtype=bool)
        for device_id in {r.device_id for r in self._regions}:
            starts = np.array([r.addr for r in self._regions if r.device_id == device_id], dtype=np.int64)
            ends = np.array(
                [r.addr + r.nbytes for r in self._regions if r.device_id == device_id], dtype=np.int64
            )
            rows = descriptors[:, 2] == device_id
            addr, nbytes = descriptors[rows, 0], descriptors[rows, 1]
            idx = np.searchsorted(starts, addr, side="right") - 1
            clipped = np.maximum(idx, 0)
            # ``nbytes <= end - addr`` rather than ``addr + nbytes <= end``: no overflow for hostile lengths.
            inside[rows] = (idx >= 0) & (nbytes <= ends[clipped] - addr)
        outside = np.flatnonzero(~inside)
        return int(outside[0]) if outside.size else None

    def check(self, descriptors: np.ndarray, field: str, owner: str) -> None:
        row = self.first_outside(descriptors)
        if row is not None:
            addr, nbytes, device_id = descriptors[row].tolist()
            raise TransportError(
                f"{field} descriptor {row} [{addr:#x}, {nbytes}, dev {device_id}] lies outside the memory "
                f"registered by {owner!r}"
            )
