"""Prefill-side holds for pull mode: finished blocks wait for every decode rank that READs them.

In pull mode decode READs prefill's blocks and the READ's notification tells prefill it is done
(NIXL delivers a READ's notification to the agent that was read). A prefill rank is read by the
decode ranks ``targets_for(prefill_rank, P_TP, D_TP)``; it frees its blocks once each of them said
so, when a decode rank gives up (an abort), or when the lease runs out. Pure logic, clock passed in.

The read-done notice is a :class:`ReadDoneMessage` naming decode's TP size, from which prefill knows
how many readers to wait for; an :class:`AbortMessage` (decode gave up) releases at once.

A notice can overtake the hold itself: the engine answers the router as soon as prefill is done,
while the hold reaches the transfer thread through a queue, so under load decode's READ may finish
first. Such early notices are kept (for one lease, at most ``max_early`` transfers) and applied
when the hold arrives; dropping them would pin the blocks for the whole lease.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdconnector.layout import targets_for
from pdconnector.protocol.deadlines import DeadlineQueue
from pdconnector.protocol.messages import AbortMessage, ReadDoneMessage
from pdconnector.protocol.pairing import PrefillBlocks
from pdconnector.protocol.rendezvous import Outcome
from pdconnector.protocol.timeline import Milestone, Timeline


@dataclass(frozen=True)
class Released:
    """Prefill may free ``blocks`` now."""

    transfer_id: str
    outcome: Outcome
    detail: str
    blocks: PrefillBlocks
    # pdconnector.protocol.timeline: where its time went
    stages: dict[str, float] = field(default_factory=dict)


@dataclass
class _Hold:
    blocks: PrefillBlocks
    deadline: float
    readers_done: set[int] = field(default_factory=set)
    timeline: Timeline = field(default_factory=Timeline)


Notice = ReadDoneMessage | AbortMessage


class PullHolds:
    def __init__(
        self, *, prefill_rank: int, prefill_tp_size: int, lease_s: float, max_early: int = 4096
    ) -> None:
        self.prefill_rank = prefill_rank
        self.prefill_tp_size = prefill_tp_size
        self.lease_s = lease_s
        self.max_early = max_early
        self._holds: dict[str, _Hold] = {}
        self._deadlines: DeadlineQueue[str] = DeadlineQueue()
        self._early: dict[str, tuple[float, list[Notice]]] = {}

    def __len__(self) -> int:
        return len(self._holds)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._holds

    def next_deadline(self) -> float | None:
        return self._deadlines.earliest()

    def early_count(self) -> int:
        """Notices waiting for a hold that has not arrived (yet)."""
        return len(self._early)

    def hold(self, blocks: PrefillBlocks, now: float) -> Released | None:
        """Hold ``blocks`` until decode is done with them; released at once if decode's notices came first."""
        if blocks.transfer_id in self._holds:
            raise ValueError(f"prefill of {blocks.transfer_id} reported finished twice")
        self._holds[blocks.transfer_id] = hold = _Hold(blocks, now + self.lease_s)
        hold.timeline.mark(Milestone.PREFILLED, now)
        self._deadlines.push(now + self.lease_s, blocks.transfer_id)
        _, early = self._early.pop(blocks.transfer_id, (0.0, []))
        for notice in early:
            released = self.notice_received(notice, now)
            if released is not None:
                return released
        return None

    def notice_received(self, message: Notice, now: float) -> Released | None:
        if message.transfer_id not in self._holds:
            self._keep_early(message, now)
            return None
        if isinstance(message, AbortMessage):
            detail = f"decode rank {message.decode_rank} aborted: {message.detail}"
            return self._release(message.transfer_id, Outcome.CANCELLED, detail, now)
        return self._read_done(message, now)

    def _keep_early(self, message: Notice, now: float) -> None:
        if message.transfer_id not in self._early:
            while len(self._early) >= self.max_early:
                del self._early[next(iter(self._early))]
            self._early[message.transfer_id] = (now + self.lease_s, [])
        self._early[message.transfer_id][1].append(message)

    def _read_done(self, message: ReadDoneMessage, now: float) -> Released | None:
        hold = self._holds[message.transfer_id]
        try:
            readers = set(targets_for(self.prefill_rank, self.prefill_tp_size, message.decode_tp_size))
        except ValueError as error:
            return self._release(message.transfer_id, Outcome.FAILED, str(error), now)
        if message.decode_rank in readers:
            hold.readers_done.add(message.decode_rank)
        if hold.readers_done >= readers:
            return self._release(
                message.transfer_id, Outcome.WRITTEN, f"read by decode ranks {sorted(readers)}", now
            )
        return None

    def cancel(self, transfer_id: str, detail: str, now: float) -> Released | None:
        return (
            self._release(transfer_id, Outcome.CANCELLED, detail, now) if transfer_id in self._holds else None
        )

    def expire(self, now: float) -> list[Released]:
        released = []
        for transfer_id in self._deadlines.due(now):
            hold = self._holds.get(transfer_id)
            if hold is not None and hold.deadline <= now:
                detail = f"no decode READ completed within the {self.lease_s}s lease"
                released.append(self._release(transfer_id, Outcome.EXPIRED, detail, now))
        self._deadlines.compact(self._holds.__contains__, len(self._holds))
        # Early notices are few and arrive in time order, so the oldest-first dict doubles as their queue.
        while self._early and next(iter(self._early.values()))[0] <= now:
            del self._early[next(iter(self._early))]
        return released

    def _release(self, transfer_id: str, outcome: Outcome, detail: str, now: float) -> Released:
        hold = self._holds.pop(transfer_id)
        hold.timeline.mark(Milestone.RELEASED, now)
        return Released(transfer_id, outcome, detail, hold.blocks, hold.timeline.stages())
