"""Prefill-side holds for pull mode: finished blocks wait for every decode rank that READs them.

In pull mode decode READs prefill's blocks and the READ's notification tells prefill it is done
(NIXL delivers a READ's notification to the agent that was read). A prefill rank is read by the
decode ranks ``targets_for(prefill_rank, P_TP, D_TP)``; it frees its blocks once each of them said
so, when a decode rank gives up (an abort), or when the lease runs out. Pure logic, clock passed in.

The read-done notice is a :class:`ReadDoneMessage` naming decode's TP size, from which prefill knows
how many readers to wait for; an :class:`AbortMessage` (decode gave up) releases at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdconnector.layout import targets_for
from pdconnector.protocol.deadlines import DeadlineQueue
from pdconnector.protocol.messages import AbortMessage, ReadDoneMessage
from pdconnector.protocol.rendezvous import Outcome, PrefillBlocks


@dataclass(frozen=True)
class Released:
    """Prefill may free ``blocks`` now."""

    transfer_id: str
    outcome: Outcome
    detail: str
    blocks: PrefillBlocks


@dataclass
class _Hold:
    blocks: PrefillBlocks
    deadline: float
    readers_done: set[int] = field(default_factory=set)


class PullHolds:
    def __init__(self, *, prefill_rank: int, prefill_tp_size: int, lease_s: float) -> None:
        self.prefill_rank = prefill_rank
        self.prefill_tp_size = prefill_tp_size
        self.lease_s = lease_s
        self._holds: dict[str, _Hold] = {}
        self._deadlines: DeadlineQueue[str] = DeadlineQueue()

    def __len__(self) -> int:
        return len(self._holds)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._holds

    def next_deadline(self) -> float | None:
        return self._deadlines.earliest()

    def hold(self, blocks: PrefillBlocks, now: float) -> None:
        if blocks.transfer_id in self._holds:
            raise ValueError(f"prefill of {blocks.transfer_id} reported finished twice")
        self._holds[blocks.transfer_id] = _Hold(blocks, now + self.lease_s)
        self._deadlines.push(now + self.lease_s, blocks.transfer_id)

    def abort_received(self, message: AbortMessage) -> Released | None:
        if message.transfer_id not in self._holds:
            return None
        return self._release(message.transfer_id, Outcome.CANCELLED, f"decode rank {message.decode_rank} aborted: {message.detail}")

    def read_done_received(self, message: ReadDoneMessage) -> Released | None:
        hold = self._holds.get(message.transfer_id)
        if hold is None:
            return None
        try:
            readers = set(targets_for(self.prefill_rank, self.prefill_tp_size, message.decode_tp_size))
        except ValueError as error:
            return self._release(message.transfer_id, Outcome.FAILED, str(error))
        if message.decode_rank in readers:
            hold.readers_done.add(message.decode_rank)
        if hold.readers_done >= readers:
            return self._release(message.transfer_id, Outcome.WRITTEN, f"read by decode ranks {sorted(readers)}")
        return None

    def cancel(self, transfer_id: str, detail: str) -> Released | None:
        return self._release(transfer_id, Outcome.CANCELLED, detail) if transfer_id in self._holds else None

    def expire(self, now: float) -> list[Released]:
        released = []
        for transfer_id in self._deadlines.due(now):
            hold = self._holds.get(transfer_id)
            if hold is not None and hold.deadline <= now:
                released.append(self._release(transfer_id, Outcome.EXPIRED, f"no decode READ completed within the {self.lease_s}s lease"))
        self._deadlines.compact(self._holds.__contains__, len(self._holds))
        return released

    def _release(self, transfer_id: str, outcome: Outcome, detail: str) -> Released:
        hold = self._holds.pop(transfer_id)
        return Released(transfer_id, outcome, detail, hold.blocks)
