"""Prefill-side rendezvous: pair decode registrations with finished prefill blocks.

One table per prefill TP rank. A transfer is keyed by the router-minted transfer
id (never by request-id surgery). Its two halves arrive in either order: the
prefill finishing (its blocks, held until the transfer ends) and one registration
per decode rank this prefill rank writes (``layout.plan.targets_for``).
Each registration pairs on its own, so writes start as soon as both halves of a
(prefill, decode rank) pair are known.

Attempts: decode re-registers with a higher attempt after a preemption or retry;
that replaces the registrations of older attempts, and a write still in flight for
an older attempt only releases its hold on the blocks when it ends: it never
counts for the new attempt. Same-attempt duplicates and lower attempts are ignored.

Pairing (``protocol.pairing``): a registration's blocks take prefill's after the prefix decode holds;
block counts that do not fit fail the transfer before any WRITE.

Leases: finished prefill blocks wait ``registration_lease_s`` for missing
registrations, registrations wait ``prefill_lease_s`` for the prefill, each write
gets ``write_timeout_s``. Whatever runs out ends the transfer and tells every known
decode rank why, so decode fails promptly instead of waiting out its own timeout.

The fence (decode's blocks are written only while decode still holds them for this transfer):

* A registration is good for ``lifetime_ms`` from the moment this table receives it (measured
  here, never by comparing two machines' clocks). No WRITE is posted for it afterwards; the
  transfer ends ``expired`` instead. So a registration that waited (a slow prefill, a frozen
  process, a lost abort) is never written into blocks decode has given up on.
* A ``FailureMessage`` to a decode rank means more than "this attempt failed": it promises this
  rank has no WRITE in flight for the transfer and will post none. It is therefore sent only when
  the transfer's writes have drained (done, failed, or cancelled as the transport confirmed), and
  decode may free its blocks on it. An ``AbortMessage`` is answered with one, to the agent that
  sent it, for the same reason (decode waits for that answer, or for its fence, before freeing).
* A write past its deadline is cancelled (``AbandonWrite``) but stays in flight until the caller
  reports the cancel confirmed (``write_failed``) or the write's real end: a write the transport
  cannot stop keeps the blocks pinned; it never counts as finished.

The table does no I/O. Every call returns events, in the order the caller must act
on them: ``StartWrite`` (post a WRITE), ``AbandonWrite`` (cancel a timed-out write;
report the outcome), ``NotifyDecode`` (send a failure notification), ``Closed`` (the
transfer ended; free ``blocks`` if set). A transfer's blocks are released by
exactly one ``Closed``, and only once no write reads them any more.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum

from pdconnector.layout.plan import targets_for
from pdconnector.protocol.deadlines import DeadlineQueue
from pdconnector.protocol.messages import (
    MAX_DETAIL_CHARS,
    AbortMessage,
    FailureMessage,
    FailureReason,
    RegistrationMessage,
)
from pdconnector.protocol.pairing import PairingError, PrefillBlocks, paired_blocks
from pdconnector.protocol.params import EngineRole
from pdconnector.protocol.timeline import Milestone, Timeline


@dataclass(frozen=True)
class RendezvousLimits:
    max_entries: int = 4096
    registration_lease_s: float = 30.0  # finished prefill blocks wait this long for decode's registrations
    prefill_lease_s: float = 300.0  # a registration waits this long for the prefill (queueing + compute)
    write_timeout_s: float = 30.0
    registration_lifetime_s: float = 30.0  # for registrations that carry no lifetime of their own
    tombstone_ttl_s: float = 600.0  # how long an ended transfer's id is remembered, to answer late arrivals
    max_tombstones: int = 16384


@dataclass(frozen=True)
class WriteKey:
    transfer_id: str
    attempt: int
    decode_rank: int


class Outcome(StrEnum):
    """How a transfer ended on one rank: prefill's ends, and decode's success (decode's failures are
    :class:`~pdconnector.protocol.messages.FailureReason` values)."""

    WRITTEN = "written"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    RECEIVED = "received"  # decode: every writer's bytes arrived
    REFUSED = "refused"  # decode: the scheduler side failed the request before any transfer


@dataclass(frozen=True)
class StartWrite:
    """Post the WRITE of ``prefill`` into ``registration``'s blocks; report its end with ``write_done`` /
    ``write_failed``.

    ``prefill`` is already paired with the registration (:func:`paired_blocks`): group for group, its blocks
    and the registered ones correspond one for one."""

    key: WriteKey
    registration: RegistrationMessage
    prefill: PrefillBlocks
    deadline: float


@dataclass(frozen=True)
class AbandonWrite:
    """The write ran past its deadline: try to cancel it. Report ``write_failed`` once the transport confirmed
    the cancel; a write that cannot be stopped stays in flight (and its blocks held) until it ends."""

    key: WriteKey


@dataclass(frozen=True)
class NotifyDecode:
    """Send ``message`` to the decode agent ``agent``: this rank has nothing in flight for the transfer any
    more."""

    agent: str
    message: FailureMessage


@dataclass(frozen=True)
class Closed:
    """The transfer ended; if ``blocks`` is set, this rank no longer needs them (report finished sending)."""

    transfer_id: str
    outcome: Outcome
    detail: str
    blocks: PrefillBlocks | None
    # pdconnector.protocol.timeline: where its time went
    stages: dict[str, float] = field(default_factory=dict)


Event = StartWrite | AbandonWrite | NotifyDecode | Closed


@dataclass(frozen=True)
class _Tombstone:
    outcome: Outcome
    detail: str
    attempt: int
    had_prefill: bool
    forget_at: float


@dataclass
class _Entry:
    transfer_id: str
    lease_deadline: float
    prefill: PrefillBlocks | None = None
    attempt: int = -1
    decode_tp_size: int = 0
    registrations: dict[int, RegistrationMessage] = field(default_factory=dict)
    destinations: frozenset[int] = frozenset()
    started: set[int] = field(default_factory=set)
    written: set[int] = field(default_factory=set)
    inflight: dict[WriteKey, float] = field(default_factory=dict)
    cancelling: set[WriteKey] = field(default_factory=set)  # past their deadline, cancel asked for
    # decode rank -> end of its registration's lifetime
    valid_until: dict[int, float] = field(default_factory=dict)
    ending: tuple[Outcome, str] | None = None  # decided, waiting for in-flight writes to drain
    # sent once the writes drained
    notices: dict[tuple[str, int], FailureMessage] = field(default_factory=dict)
    timeline: Timeline = field(default_factory=Timeline)

    def waiting(self) -> bool:
        return self.prefill is None or not self.destinations or set(self.registrations) != self.destinations


class RendezvousTable:
    def __init__(
        self,
        *,
        prefill_rank: int,
        prefill_tp_size: int,
        block_size: int,
        ssm_groups: frozenset[int] = frozenset(),
        limits: RendezvousLimits | None = None,
        layout_fingerprint: str = "",
    ) -> None:
        """``block_size``: tokens per attention block; ``ssm_groups``: the KV groups holding SSM state (see
        :func:`paired_blocks`)."""
        if not 0 <= prefill_rank < prefill_tp_size:
            raise ValueError(f"prefill rank {prefill_rank} outside TP size {prefill_tp_size}")
        if block_size <= 0:
            raise ValueError(f"block size must be positive, got {block_size}")
        self.prefill_rank = prefill_rank
        self.prefill_tp_size = prefill_tp_size
        self.block_size = block_size
        self.ssm_groups = ssm_groups
        self.limits = limits or RendezvousLimits()
        self.layout_fingerprint = layout_fingerprint
        self._entries: dict[str, _Entry] = {}
        self._tombstones: OrderedDict[str, _Tombstone] = OrderedDict()
        self._deadlines: DeadlineQueue[str] = DeadlineQueue()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._entries

    def next_deadline(self) -> float | None:
        """When ``expire`` may next have work (possibly early, never late)."""
        return self._deadlines.earliest()

    # --- inputs -------------------------------------------------------------------------------

    def prefill_finished(
        self, transfer_id: str, block_ids: tuple[tuple[int, ...], ...], num_tokens: int, now: float
    ) -> list[Event]:
        """This rank's prefill of ``transfer_id`` finished; the table holds ``block_ids`` until a ``Closed``
        releases them."""
        blocks = PrefillBlocks(transfer_id, tuple(tuple(group) for group in block_ids), num_tokens)
        tombstone = self._tombstone(transfer_id, now)
        if tombstone is not None:
            if tombstone.had_prefill:
                raise ValueError(f"prefill of {transfer_id} reported finished twice")
            self._bury(
                transfer_id,
                tombstone.outcome,
                tombstone.detail,
                attempt=tombstone.attempt,
                had_prefill=True,
                now=now,
            )
            return [
                Closed(
                    transfer_id,
                    tombstone.outcome,
                    f"prefill finished after the transfer ended ({tombstone.detail})",
                    blocks,
                )
            ]
        entry = self._entries.get(transfer_id)
        if entry is None:
            if len(self._entries) >= self.limits.max_entries:
                return [
                    Closed(
                        transfer_id,
                        Outcome.REJECTED,
                        f"rendezvous table full ({self.limits.max_entries} transfers)",
                        blocks,
                    )
                ]
            entry = self._add(transfer_id, now + self.limits.registration_lease_s)
        elif entry.prefill is not None:
            raise ValueError(f"prefill of {transfer_id} reported finished twice")
        else:
            self._set_lease(entry, now + self.limits.registration_lease_s)
        entry.prefill = blocks
        entry.timeline.mark(Milestone.PREFILLED, now)
        return self._pair(entry, now)

    def registration_received(self, message: RegistrationMessage, now: float) -> list[Event]:
        """A decode rank's registration arrived (already decoded and schema-checked)."""
        problem = self._incompatibility(message)
        entry = self._entries.get(message.transfer_id)
        if entry is None:
            refusal = self._refuse_new(message, problem, now)
            if refusal is not None:
                return refusal
            entry = self._add(message.transfer_id, now + self.limits.prefill_lease_s)
        if message.attempt < entry.attempt or (
            message.attempt == entry.attempt
            and (entry.ending or message.decode_tp_rank in entry.registrations)
        ):
            return []  # stale attempt or duplicate
        if entry.ending is not None:
            failure = self._failure(
                message.transfer_id,
                message.attempt,
                FailureReason.ALREADY_CLOSED,
                f"transfer is ending: {entry.ending[1]}",
            )
            entry.notices.setdefault((message.agent_name, message.attempt), failure)
            return []
        if (
            problem is None
            and message.attempt == entry.attempt
            and message.decode_tp_size != entry.decode_tp_size
        ):
            detail = (
                f"decode TP size {message.decode_tp_size} differs from the other ranks' "
                f"{entry.decode_tp_size}"
            )
            problem = FailureReason.INVALID_REGISTRATION, detail
        if problem is not None:
            return self._end(entry, Outcome.FAILED, *problem, now=now, also_notify=message)
        if message.attempt > entry.attempt:
            self._begin_attempt(entry, message, now)
        entry.registrations[message.decode_tp_rank] = message
        lifetime = message.lifetime_ms / 1000 if message.lifetime_ms else self.limits.registration_lifetime_s
        entry.valid_until[message.decode_tp_rank] = now + lifetime
        self._deadlines.push(now + lifetime, entry.transfer_id)
        entry.timeline.mark(Milestone.REGISTERED, now)
        return self._pair(entry, now)

    def write_done(self, key: WriteKey, now: float) -> list[Event]:
        """The WRITE for ``key`` completed (its completion notification went with it)."""
        entry = self._entries.get(key.transfer_id)
        if entry is None or entry.inflight.pop(key, None) is None:
            return []  # unknown: already accounted for
        entry.cancelling.discard(key)
        if entry.ending is None and key.attempt == entry.attempt:
            entry.written.add(key.decode_rank)
            entry.timeline.mark(Milestone.WRITTEN, now)
        return self._settle(entry, now)

    def write_failed(self, key: WriteKey, detail: str, now: float) -> list[Event]:
        """The WRITE for ``key`` failed, or was cancelled and the transport confirmed it; either way it no
        longer touches decode's memory. A failure of the current attempt ends the transfer."""
        entry = self._entries.get(key.transfer_id)
        if entry is None or entry.inflight.pop(key, None) is None:
            return []
        entry.cancelling.discard(key)
        if entry.ending is None and key.attempt == entry.attempt:
            return self._end(entry, Outcome.FAILED, FailureReason.WRITE_FAILED, detail, now=now)
        return self._settle(entry, now)

    def abort_received(self, message: AbortMessage, now: float, *, sender: str) -> list[Event]:
        """Decode (agent ``sender``) gave up on ``message.attempt``: stop, free, and answer once nothing is in
        flight (decode keeps its blocks until that answer or its fence)."""
        ack = self._failure(
            message.transfer_id, message.attempt, FailureReason.CANCELLED, "abort received; nothing in flight"
        )
        entry = self._entries.get(message.transfer_id)
        if entry is None:
            # Remember it so a prefill finishing later is freed at once and a late registration is answered.
            if self._tombstone(message.transfer_id, now) is None:
                detail = f"decode aborted: {message.detail}"
                self._bury(
                    message.transfer_id,
                    Outcome.CANCELLED,
                    detail,
                    attempt=message.attempt,
                    had_prefill=False,
                    now=now,
                )
            return [NotifyDecode(sender, ack)]
        entry.notices.setdefault((sender, message.attempt), ack)
        if message.attempt >= entry.attempt and entry.ending is None:
            entry.ending = (Outcome.CANCELLED, f"decode aborted: {message.detail}")
        return self._settle(entry, now)

    def cancel(self, transfer_id: str, detail: str, now: float) -> list[Event]:
        """This side gave up on the transfer (e.g. the prefill request was aborted); tells known decode
        ranks."""
        entry = self._entries.get(transfer_id)
        if entry is None:
            if self._tombstone(transfer_id, now) is None:
                self._bury(transfer_id, Outcome.CANCELLED, detail, attempt=-1, had_prefill=False, now=now)
            return []
        if entry.ending is not None:
            return []
        return self._end(entry, Outcome.CANCELLED, FailureReason.CANCELLED, detail, now=now)

    def expire(self, now: float) -> list[Event]:
        """Apply every deadline ``<= now``; call it whenever ``next_deadline()`` has passed."""
        events: list[Event] = []
        for transfer_id in self._deadlines.due(now):
            entry = self._entries.get(transfer_id)
            if entry is not None:
                events += self._expire_entry(entry, now)
        while self._tombstones:
            transfer_id, tombstone = next(iter(self._tombstones.items()))
            if tombstone.forget_at > now:
                break
            del self._tombstones[transfer_id]
        self._deadlines.compact(self._entries.__contains__, len(self._entries))
        return events

    # --- transitions --------------------------------------------------------------------------

    def _add(self, transfer_id: str, lease_deadline: float) -> _Entry:
        entry = _Entry(transfer_id, lease_deadline)
        self._entries[transfer_id] = entry
        self._deadlines.push(lease_deadline, transfer_id)
        return entry

    def _set_lease(self, entry: _Entry, deadline: float) -> None:
        entry.lease_deadline = deadline
        self._deadlines.push(deadline, entry.transfer_id)

    def _begin_attempt(self, entry: _Entry, message: RegistrationMessage, now: float) -> None:
        entry.attempt = message.attempt
        entry.decode_tp_size = message.decode_tp_size
        entry.registrations = {}
        entry.valid_until = {}
        entry.started = set()
        entry.written = set()
        entry.destinations = frozenset(
            targets_for(self.prefill_rank, self.prefill_tp_size, message.decode_tp_size)
        )
        if entry.prefill is not None:
            # Decode is alive and retrying: give the new attempt a full lease on the held blocks.
            self._set_lease(entry, now + self.limits.registration_lease_s)

    def _refuse_new(
        self, message: RegistrationMessage, problem: tuple[FailureReason, str] | None, now: float
    ) -> list[Event] | None:
        """The answer to a registration that would open a new entry, or None to open it."""
        tombstone = self._tombstone(message.transfer_id, now)
        if tombstone is not None:
            if tombstone.outcome is Outcome.WRITTEN and message.attempt <= tombstone.attempt:
                return []  # a resent registration of a transfer that succeeded: nothing to tell
            return [
                self._notify(
                    message,
                    FailureReason.ALREADY_CLOSED,
                    f"transfer ended: {tombstone.outcome} ({tombstone.detail})",
                )
            ]
        if problem is not None:
            return [self._notify(message, *problem)]
        if len(self._entries) >= self.limits.max_entries:
            return [
                self._notify(
                    message,
                    FailureReason.CAPACITY,
                    f"rendezvous table full ({self.limits.max_entries} transfers)",
                )
            ]
        return None

    def _pair(self, entry: _Entry, now: float) -> list[Event]:
        """Start the writes whose both halves are known, unless the halves do not fit together."""
        if entry.prefill is None:
            return []
        pending = [
            (rank, registration)
            for rank, registration in sorted(entry.registrations.items())
            if rank not in entry.started
        ]
        lapsed = [rank for rank, _ in pending if entry.valid_until[rank] <= now]
        if lapsed:
            return self._end(
                entry, Outcome.EXPIRED, FailureReason.LEASE_EXPIRED, self._lapsed_detail(lapsed), now=now
            )
        writes: list[tuple[int, RegistrationMessage, PrefillBlocks]] = []
        for rank, registration in pending:
            try:
                source = paired_blocks(
                    entry.prefill, registration, block_size=self.block_size, ssm_groups=self.ssm_groups
                )
            except PairingError as error:
                return self._end(entry, Outcome.FAILED, error.reason, str(error), now=now)
            writes.append((rank, registration, source))
        events: list[Event] = []
        deadline = now + self.limits.write_timeout_s
        for rank, registration, source in writes:
            key = WriteKey(entry.transfer_id, entry.attempt, rank)
            entry.started.add(rank)
            entry.inflight[key] = deadline
            events.append(StartWrite(key, registration, source, deadline))
        if events:
            self._deadlines.push(deadline, entry.transfer_id)
            entry.timeline.mark(Milestone.POSTED, now)
        return events

    def _expire_entry(self, entry: _Entry, now: float) -> list[Event]:
        timed_out = [
            key for key, deadline in entry.inflight.items() if deadline <= now and key not in entry.cancelling
        ]
        events: list[Event] = []
        for key in timed_out:
            entry.cancelling.add(key)
            events.append(AbandonWrite(key))
        if entry.ending is None:
            if any(key.attempt == entry.attempt for key in timed_out):
                detail = f"WRITE not done within {self.limits.write_timeout_s}s"
                return events + self._end(entry, Outcome.FAILED, FailureReason.WRITE_TIMEOUT, detail, now=now)
            lapsed = [
                rank
                for rank in entry.registrations
                if rank not in entry.started and entry.valid_until[rank] <= now
            ]
            if lapsed:
                return events + self._end(
                    entry, Outcome.EXPIRED, FailureReason.LEASE_EXPIRED, self._lapsed_detail(lapsed), now=now
                )
            if entry.waiting() and entry.lease_deadline <= now:
                missing = "prefill did not finish" if entry.prefill is None else "decode did not register"
                return events + self._end(
                    entry,
                    Outcome.EXPIRED,
                    FailureReason.LEASE_EXPIRED,
                    f"{missing} before the lease ran out",
                    now=now,
                )
        return events + self._settle(entry, now)

    def _end(
        self,
        entry: _Entry,
        outcome: Outcome,
        reason: FailureReason,
        detail: str,
        *,
        now: float,
        also_notify: RegistrationMessage | None = None,
    ) -> list[Event]:
        """Decide the transfer's outcome and close it once its writes have drained; decode is told then."""
        entry.ending = (outcome, f"{reason}: {detail}")
        destinations = [registration for _, registration in sorted(entry.registrations.items())]
        if also_notify is not None:
            destinations.append(also_notify)
        for registration in destinations:
            failure = self._failure(registration.transfer_id, registration.attempt, reason, detail)
            entry.notices.setdefault((registration.agent_name, registration.attempt), failure)
        return self._settle(entry, now)

    def _settle(self, entry: _Entry, now: float) -> list[Event]:
        if entry.ending is None and entry.destinations and entry.written >= entry.destinations:
            entry.ending = (
                Outcome.WRITTEN,
                f"attempt {entry.attempt} written to decode ranks {sorted(entry.written)}",
            )
        if entry.ending is None or entry.inflight:
            return []
        del self._entries[entry.transfer_id]
        outcome, detail = entry.ending
        self._bury(
            entry.transfer_id,
            outcome,
            detail,
            attempt=entry.attempt,
            had_prefill=entry.prefill is not None,
            now=now,
        )
        notices: list[Event] = [NotifyDecode(agent, message) for (agent, _), message in entry.notices.items()]
        entry.timeline.mark(Milestone.RELEASED, now)
        return [*notices, Closed(entry.transfer_id, outcome, detail, entry.prefill, entry.timeline.stages())]

    # --- helpers ------------------------------------------------------------------------------

    def _notify(self, destination: RegistrationMessage, reason: FailureReason, detail: str) -> NotifyDecode:
        """An answer to a registration that opened nothing (so nothing of it is in flight)."""
        return NotifyDecode(
            destination.agent_name,
            self._failure(destination.transfer_id, destination.attempt, reason, detail),
        )

    def _failure(self, transfer_id: str, attempt: int, reason: FailureReason, detail: str) -> FailureMessage:
        return FailureMessage(
            transfer_id=transfer_id,
            attempt=attempt,
            side=EngineRole.PREFILL,
            rank=self.prefill_rank,
            reason=reason,
            detail=detail[:MAX_DETAIL_CHARS],
        )

    @staticmethod
    def _lapsed_detail(ranks: list[int]) -> str:
        return (
            f"the registrations of decode ranks {sorted(ranks)} outlived their lifetime before prefill "
            "could write them"
        )

    def _incompatibility(self, message: RegistrationMessage) -> tuple[FailureReason, str] | None:
        try:
            destinations = targets_for(self.prefill_rank, self.prefill_tp_size, message.decode_tp_size)
        except ValueError as error:
            return FailureReason.INCOMPATIBLE, str(error)
        if message.decode_tp_rank not in destinations:
            return (
                FailureReason.INVALID_REGISTRATION,
                f"decode rank {message.decode_tp_rank} is not written by prefill rank {self.prefill_rank}",
            )
        if (
            self.layout_fingerprint
            and message.layout_fingerprint
            and message.layout_fingerprint != self.layout_fingerprint
        ):
            return (
                FailureReason.INCOMPATIBLE,
                f"layout fingerprint {message.layout_fingerprint!r} differs from prefill's "
                f"{self.layout_fingerprint!r}",
            )
        return None

    def _tombstone(self, transfer_id: str, now: float) -> _Tombstone | None:
        tombstone = self._tombstones.get(transfer_id)
        if tombstone is None or tombstone.forget_at <= now:
            return None
        return tombstone

    def _bury(
        self, transfer_id: str, outcome: Outcome, detail: str, *, attempt: int, had_prefill: bool, now: float
    ) -> None:
        self._tombstones.pop(transfer_id, None)
        self._tombstones[transfer_id] = _Tombstone(
            outcome, detail, attempt, had_prefill, now + self.limits.tombstone_ttl_s
        )
        while len(self._tombstones) > self.limits.max_tombstones:
            self._tombstones.popitem(last=False)
