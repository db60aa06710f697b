"""Which blocks the tier holds and where: block hash -> slot, sans-I/O (the copies are the worker's).

A slot is *free*, *being written* (a save in flight: not readable, not evictable), or *ready* (readable). A
ready slot being read by a load is pinned (a count: several requests may load the same prefix) and is not
evicted; ready slots nobody reads are evicted least recently used first when a save needs room. A prompt's
blocks are used as a chain, head first, and a hit is a chain's prefix: so each use refreshes a chain tail
first, leaving its head the most recent, and eviction takes a conversation's last blocks before its first
(what stays is still a readable prefix; evicting the head would strand the rest). A save never evicts the
chain it saves. A hash is
readable only once its save was committed, so a load never reads a block before it landed, and a save that
failed gives its slot back. vLLM's block hashes chain each block to everything before it, so a hit is the same
tokens at the same positions (of the same model: a tier belongs to one engine).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

BlockHash = Hashable


@dataclass
class _Entry:
    slot: int
    ready: bool = False
    readers: int = 0


class TierIndex:
    def __init__(self, capacity_slots: int) -> None:
        if capacity_slots < 1:
            raise ValueError(f"a tier needs at least one slot, got {capacity_slots}")
        self.capacity_slots = capacity_slots
        self._free = list(range(capacity_slots - 1, -1, -1))  # popped from the end: slot 0 first
        # every hash with a slot, least recently used first
        self._entries: OrderedDict[BlockHash, _Entry] = OrderedDict()
        self.evictions = 0
        self._evicted: list[BlockHash] = []  # since the last take_evicted

    def __len__(self) -> int:
        """Hashes holding a slot (ready or being written)."""
        return len(self._entries)

    def __contains__(self, block_hash: object) -> bool:
        entry = self._entries.get(block_hash)  # type: ignore[call-overload]
        return entry is not None and entry.ready

    def longest_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The slots of the leading ``hashes`` the tier can be read from, up to the first it cannot."""
        slots = []
        for block_hash in hashes:
            entry = self._entries.get(block_hash)
            if entry is None or not entry.ready:
                break
            slots.append(entry.slot)
        return slots

    def pin(self, hashes: Iterable[BlockHash]) -> list[int]:
        """Start reading ``hashes`` (each ready): their slots, kept until :meth:`unpin`."""
        hashes = list(hashes)
        entries = [self._entries.get(block_hash) for block_hash in hashes]
        if any(entry is None or not entry.ready for entry in entries):
            raise KeyError(f"not every hash is ready to read: {hashes}")
        slots = []
        for entry in entries:
            assert entry is not None
            entry.readers += 1
            slots.append(entry.slot)
        self.touch(hashes)
        return slots

    def touch(self, chain: Sequence[BlockHash]) -> None:
        """A prompt used ``chain`` (head first): its held hashes become the most recently used, tail first."""
        for block_hash in reversed(chain):
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)

    def unpin(self, hashes: Iterable[BlockHash]) -> None:
        for block_hash in hashes:
            entry = self._entries[block_hash]
            if entry.readers < 1:
                raise ValueError(f"{block_hash!r} is not being read")
            entry.readers -= 1

    def reserve(self, chain: Sequence[BlockHash]) -> dict[BlockHash, int]:
        """Slots to save ``chain``'s blocks (a prompt's, head first) into, evicting unread ready blocks of
        other chains least recently used first; a hash the tier holds or is writing already gets none (it
        is saved once, and is touched). Stops when no slot can be freed: the hashes without one are not
        saved."""
        self.touch(chain)
        own = set(chain)
        reserved: dict[BlockHash, int] = {}
        for block_hash in chain:
            if block_hash in self._entries or block_hash in reserved:
                continue
            slot = self._take_slot(keep=own)
            if slot is None:
                break
            self._entries[block_hash] = _Entry(slot)
            reserved[block_hash] = slot
        return reserved

    def commit(self, hashes: Sequence[BlockHash]) -> None:
        """The saves of ``hashes`` (a run of a chain, head first) landed: readable from now on."""
        for block_hash in hashes:
            entry = self._entries[block_hash]
            if entry.ready:
                raise ValueError(f"{block_hash!r} was committed already")
            entry.ready = True
        self.touch(hashes)

    def abandon(self, hashes: Iterable[BlockHash]) -> None:
        """The saves of ``hashes`` failed: their slots are free again."""
        for block_hash in hashes:
            entry = self._entries[block_hash]
            if entry.ready:
                raise ValueError(f"{block_hash!r} is ready: only a save in flight is abandoned")
            del self._entries[block_hash]
            self._free.append(entry.slot)

    def take_evicted(self) -> list[BlockHash]:
        """The readable hashes evicted since the last call, in order."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def _take_slot(self, keep: set[BlockHash]) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash, entry in self._entries.items():
            if entry.ready and entry.readers == 0 and block_hash not in keep:
                del self._entries[block_hash]
                self.evictions += 1
                self._evicted.append(block_hash)
                return entry.slot
        return None
