"""A rank's staging buffer: the slots transfers hold in it and the copies between the KV cache and a slot.

A fragmented request costs a descriptor per run (``pdconnector.layout.staging``); on the staged path the
source gathers its runs into a slot of its own buffer, one WRITE moves the slot into a slot the destination
offered in its registration, and the destination scatters it into its blocks before it reports the request
received. A slot belongs to one transfer from the moment it is taken until its holder gives it back: prefill
once its WRITE ended, decode once the transfer is reported (received, or failed after the fence), so a peer
never writes into a slot that holds something else.

The copies run on the buffer's device through torch (imported only when a rank stages): one indexed copy per
KV region the request touches, on a stream of their own that is synchronised before the copy returns, so a
WRITE posted after a gather reads finished bytes and a request reported after a scatter finds its KV in
place. The KV cache is addressed through its registered regions, so the worker needs no engine tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdconnector.layout import RankLayout, TransferPlan
from pdconnector.layout.staging import (
    PathCosts,
    SlotCopy,
    TransferPath,
    choose_path,
    received_plan,
    scatter_copy,
)
from pdconnector.protocol.messages import CompletionMessage, StagingOffer
from pdconnector.transport.base import Device, MemoryRegion

SLOT_ALIGNMENT = 256  # bytes: a slot starts where any dtype's rows may


@dataclass(frozen=True)
class StagingConfig:
    """``nbytes``: the rank's staging buffer (0: none); ``slots``: how many transfers it serves at once;
    ``path``: force a path (None: ``costs`` choose per request)."""

    nbytes: int = 0
    slots: int = 2
    path: TransferPath | None = None
    costs: PathCosts = field(default_factory=PathCosts)

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            raise ValueError(f"staging nbytes must not be negative, got {self.nbytes}")
        if self.slots < 1:
            raise ValueError(f"staging slots must be at least 1, got {self.slots}")
        if self.nbytes and self.nbytes // self.slots < SLOT_ALIGNMENT:
            raise ValueError(
                f"a staging buffer of {self.nbytes} B cut into {self.slots} slots leaves under "
                f"{SLOT_ALIGNMENT} B per slot"
            )

    @property
    def slot_bytes(self) -> int:
        return self.nbytes // self.slots // SLOT_ALIGNMENT * SLOT_ALIGNMENT


@dataclass(frozen=True)
class Slot:
    index: int
    addr: int
    nbytes: int


class RegionRows:
    """A rank's KV regions as byte tensors on their device (sharing their memory), and the indexed copies of a
    :class:`SlotCopy` between them and staging bytes. Copies are queued on the current stream; the caller
    synchronises."""

    def __init__(self, regions: Sequence[MemoryRegion]) -> None:
        if not regions:
            raise ValueError("region rows need the rank's KV regions")
        self.torch = torch = importlib.import_module("torch")
        kind, device_id = regions[0].device, regions[0].device_id
        self.device = torch.device("cuda", device_id) if kind is Device.VRAM else torch.device("cpu")
        self._kv = [_bytes_at(torch, r, self.device) for r in regions]

    def gather(self, copy: SlotCopy, staged: Any) -> None:
        """The KV rows of ``copy`` into ``staged`` (a byte tensor of ``copy.nbytes`` on this device)."""
        self._copy(copy, staged, into_slot=True)

    def scatter(self, copy: SlotCopy, staged: Any) -> None:
        """``staged`` (``copy.nbytes`` bytes) into the KV rows of ``copy``."""
        self._copy(copy, staged, into_slot=False)

    def _copy(self, copy: SlotCopy, staged: Any, *, into_slot: bool) -> None:
        if not copy.nbytes:
            return
        torch, row = self.torch, copy.row_bytes
        staged = staged[: copy.nbytes].view(-1, row)
        parts = copy.by_region()
        # A region's slot rows are one run when the source's order follows the destination's (always so for
        # the destination's own copy): that run is copied into or out of directly, and only other regions'
        # slot rows are needed on the device.
        runs = [int(slots[-1]) - int(slots[0]) + 1 == slots.size for _, _, slots in parts]
        needed = [rows for _, rows, _ in parts] + [
            slots for (_, _, slots), run in zip(parts, runs, strict=True) if not run
        ]
        # One upload for every region: a layer-outer cache has a region per layer, and an upload each would
        # cost more than the copies.
        index = torch.from_numpy(np.concatenate(needed).astype(np.int64, copy=False)).to(self.device)
        start, slots_at = 0, sum(rows.size for _, rows, _ in parts)
        for (region, rows, slots), run in zip(parts, runs, strict=True):
            kv, kv_rows = _rows(self._kv[region], row), index[start : start + rows.size]
            start += rows.size
            if run:
                part = staged[int(slots[0]) : int(slots[-1]) + 1]
                if into_slot:
                    torch.index_select(kv, 0, kv_rows, out=part)
                else:
                    kv.index_copy_(0, kv_rows, part)
                continue
            slot_rows = index[slots_at : slots_at + slots.size]
            slots_at += slots.size
            if into_slot:
                staged.index_copy_(0, slot_rows, kv.index_select(0, kv_rows))
            else:
                kv.index_copy_(0, kv_rows, staged.index_select(0, slot_rows))


class StagingBuffer:
    """Staging memory on the device of ``regions`` (the rank's KV regions) in ``config.slots`` slots."""

    def __init__(self, regions: Sequence[MemoryRegion], config: StagingConfig) -> None:
        if not config.nbytes:
            raise ValueError("a staging buffer needs staging nbytes > 0")
        self.config = config  # its path and costs too: they matter only where a buffer exists
        self._rows = RegionRows(regions)
        torch, device = self._rows.torch, self._rows.device
        self._torch = torch
        self._buffer = torch.empty(config.nbytes, dtype=torch.uint8, device=device)
        self.region = MemoryRegion(
            self._buffer.data_ptr(), config.nbytes, regions[0].device, regions[0].device_id
        )
        self._stream = torch.cuda.Stream(device) if regions[0].device is Device.VRAM else None
        self._slots = [
            Slot(i, self.region.addr + i * config.slot_bytes, config.slot_bytes) for i in range(config.slots)
        ]
        self._free = list(reversed(range(config.slots)))
        self._held: dict[Hashable, Slot] = {}

    # --- slots ----------------------------------------------------------------------------------------------

    @property
    def slot_bytes(self) -> int:
        return self._slots[0].nbytes

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take(self, holder: Hashable) -> Slot | None:
        """The slot ``holder`` holds, or a free one now held by it; None when every slot is held."""
        slot = self._held.get(holder)
        if slot is None and self._free:
            slot = self._held[holder] = self._slots[self._free.pop()]
        return slot

    def held(self, holder: Hashable) -> Slot | None:
        return self._held.get(holder)

    def give_back(self, holder: Hashable) -> None:
        slot = self._held.pop(holder, None)
        if slot is not None:
            self._free.append(slot.index)

    # --- copies (synchronised: a WRITE posted after a gather reads finished bytes) ------------------------

    def gather(self, copy: SlotCopy, addr: int) -> None:
        """Copy the KV rows of ``copy`` into the staging bytes from ``addr`` on (a slot or a share of one)."""
        self._copy(copy, addr, into_slot=True)

    def scatter(self, copy: SlotCopy, addr: int) -> None:
        """Copy the staging bytes from ``addr`` on into the KV rows of ``copy``."""
        self._copy(copy, addr, into_slot=False)

    def _copy(self, copy: SlotCopy, addr: int, *, into_slot: bool) -> None:
        start = addr - self.region.addr
        if start < 0 or start + copy.nbytes > self.region.nbytes:
            raise ValueError(
                f"staging copy of {copy.nbytes} B at offset {start} leaves the {self.region.nbytes}-B buffer"
            )
        staged = self._buffer[start : start + copy.nbytes]
        stream = (
            self._torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        )
        with stream:
            (self._rows.gather if into_slot else self._rows.scatter)(copy, staged)
        if self._stream is not None:
            self._stream.synchronize()


def _rows(kv: Any, row: int) -> Any:
    return kv[: kv.numel() // row * row].view(-1, row)


class _CudaBytes:
    """Device memory at a raw address, as torch reads it through the CUDA array interface (no copy)."""

    def __init__(self, region: MemoryRegion) -> None:
        self.__cuda_array_interface__ = {
            "shape": (region.nbytes,),
            "typestr": "|u1",
            "data": (region.addr, False),
            "version": 3,
        }


def _bytes_at(torch: Any, region: MemoryRegion, device: Any) -> Any:
    """A uint8 tensor over a registered region, sharing its memory."""
    if region.device is Device.VRAM:
        return torch.as_tensor(_CudaBytes(region), device=device)
    array = np.ctypeslib.as_array((ctypes.c_uint8 * region.nbytes).from_address(region.addr))
    return torch.from_numpy(array)


# --- decode: offering a slot, scattering what landed in it --------------------------------------------------


@dataclass(frozen=True)
class StagedShare:
    """One writer's share of a slot decode offered: where its bytes may land and where they scatter to."""

    offer: StagingOffer
    plan: TransferPlan  # the writer's bytes as this rank plans them (``received_plan``)


def offer_slot(
    staging: StagingBuffer | None,
    layout: RankLayout,
    *,
    transfer_id: str,
    prefill_tp_size: int,
    writers: Sequence[int],
    blocks: Sequence[Sequence[int]],
    num_tokens: int,
) -> dict[int, StagedShare]:
    """Per writer (prefill rank of a TP-``prefill_tp_size`` engine), the share of a slot for ``transfer_id``
    a registration offers; empty without a buffer, a free slot, or a writer whose bytes the cost model would
    stage (judged by this side's runs, a lower bound on the writer's descriptors), so a slot is not held for
    transfers that go direct."""
    if staging is None or staging.config.path is TransferPath.DIRECT or not writers:
        return {}
    path, costs = staging.config.path, staging.config.costs
    share = staging.slot_bytes // len(writers) // SLOT_ALIGNMENT * SLOT_ALIGNMENT
    plans = {
        rank: received_plan(layout, prefill_tp_size, rank, blocks, num_tokens=num_tokens) for rank in writers
    }
    worth = path is TransferPath.STAGED or any(
        choose_path(len(plan), plan.nbytes, share, costs).path is TransferPath.STAGED
        for plan in plans.values()
    )
    slot = staging.take(transfer_id) if worth else None
    if slot is None:
        return {}
    return {
        rank: StagedShare(
            StagingOffer(prefill_rank=rank, address=slot.addr + i * share, nbytes=share), plans[rank]
        )
        for i, rank in enumerate(sorted(writers))
    }


def scatter_staged(
    staging: StagingBuffer | None, message: CompletionMessage, shares: Mapping[int, StagedShare]
) -> None:
    """Scatter the staged share ``message`` announces into the blocks, from the slot share offered to its
    writer (``shares``); a share never offered, or not the size this rank expects from that writer, is a
    ``ValueError`` and never scattered."""
    share = shares.get(message.prefill_rank)
    if staging is None or share is None:
        raise ValueError(f"prefill rank {message.prefill_rank} staged without an offer")
    plan = share.plan
    if plan.nbytes != message.bytes_written or plan.nbytes > share.offer.nbytes:
        raise ValueError(
            f"prefill rank {message.prefill_rank} staged {message.bytes_written} B into a "
            f"{share.offer.nbytes}-B offer, this rank expects {plan.nbytes} B from it"
        )
    staging.scatter(scatter_copy(plan), share.offer.address)
