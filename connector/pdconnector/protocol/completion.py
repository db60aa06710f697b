"""Decode-side completion counting and the fence: a transfer is received when every prefill rank that writes
it said so, and a failed one is reported only once no prefill rank can still write into its blocks.

One tracker per decode TP rank. ``expect`` is called when this rank registers an attempt, with the prefill
ranks that will write into it (``layout.plan.writers_for``) and a deadline. Completions count distinct
expected ranks of the current attempt only: duplicates, strangers and stale attempts are ignored, so a WRITE
that belonged to an attempt decode already replaced never completes the new one.

States of one transfer (its blocks stay registered, and the engine keeps them, until it is reported)::

    RECEIVING --every writer completed-------------------------------------------> reported finished
        |  a writer's FailureMessage, the deadline, a local cancel or failure
        v
    FENCED (aborts sent to the writers not yet quiet)
        |  every writer quiet, or the fence passed
        v
    reported failed

A writer is *quiet* once it can no longer touch the blocks: its completion arrived (the WRITE landed), or
its ``FailureMessage`` did (prefill sends one only when nothing of the transfer is in flight, and answers
every abort with one). A writer that answers nothing (frozen, gone) is taken as quiet when the fence
(``fence_s`` after the failure) has passed: long enough for a frozen prefill to be killed by its liveness
probe and for any WRITE it posted within the registration's lifetime to have ended (see
:mod:`pdconnector.protocol.liveness`). Such releases are counted in ``unconfirmed`` so they show in metrics.
``poll`` reports each transfer's end exactly once, together with the aborts to send, and each transfer that
entered FENCED without being released at once (``failing``): its request may be answered then, while its
blocks stay registered until the transfer shows in ``failed``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pdconnector.protocol.deadlines import DeadlineQueue
from pdconnector.protocol.messages import CompletionMessage, FailureMessage, FailureReason, Message
from pdconnector.protocol.params import EngineRole


@dataclass(frozen=True)
class TransferFailure:
    transfer_id: str
    attempt: int
    side: EngineRole  # who gave up: the prefill side (notified) or decode itself (deadline, cancel)
    reason: FailureReason
    detail: str
    unconfirmed: tuple[int, ...] = ()  # writers released by the fence, without their answer


@dataclass(frozen=True)
class ReceivedTransfer:
    transfer_id: str
    attempt: int
    bytes_written: int  # summed over the writers' completion messages


@dataclass(frozen=True)
class AbortWriters:
    """Tell ``ranks`` (prefill ranks) that decode gave up on ``attempt``; each answers once it is quiet."""

    transfer_id: str
    attempt: int
    ranks: tuple[int, ...]
    detail: str


@dataclass(frozen=True)
class PollResult:
    finished: tuple[ReceivedTransfer, ...] = ()
    failed: tuple[TransferFailure, ...] = ()
    aborts: tuple[AbortWriters, ...] = ()
    failing: tuple[TransferFailure, ...] = ()  # fenced since the last poll, a writer not yet quiet

    @property
    def finished_ids(self) -> set[str]:
        return {received.transfer_id for received in self.finished}

    @property
    def failed_ids(self) -> set[str]:
        return {failure.transfer_id for failure in self.failed}


@dataclass
class _Expectation:
    attempt: int
    writers: frozenset[int]
    deadline: float
    arrived: set[int] = field(default_factory=set)
    quiet: set[int] = field(default_factory=set)
    bytes_written: int = 0
    failure: TransferFailure | None = None  # set: FENCED, waiting for the writers to be quiet
    fence_until: float = 0.0

    def due(self) -> float:
        return self.fence_until if self.failure is not None else self.deadline


class CompletionTracker:
    def __init__(self, *, fence_s: float, max_pending: int = 65536) -> None:
        if fence_s < 0:
            raise ValueError(f"fence_s must not be negative, got {fence_s}")
        self.fence_s = fence_s
        self.max_pending = max_pending
        self._pending: dict[str, _Expectation] = {}
        self._finished: list[ReceivedTransfer] = []
        self._failed: list[TransferFailure] = []
        self._aborts: list[AbortWriters] = []
        self._failing: list[TransferFailure] = []
        # the pending transfers that failed and wait for their writers to be quiet
        self._fenced: set[str] = set()
        self._deadlines: DeadlineQueue[str] = DeadlineQueue()

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._pending

    def fenced(self) -> int:
        """Transfers that failed and wait for their writers to be quiet (their blocks still held)."""
        return len(self._fenced)

    def is_fenced(self, transfer_id: str) -> bool:
        return transfer_id in self._fenced

    def next_deadline(self) -> float | None:
        return self._deadlines.earliest()

    def expect(self, transfer_id: str, attempt: int, writer_ranks: Iterable[int], deadline: float) -> None:
        """Wait for one completion from each of ``writer_ranks`` for ``attempt`` by ``deadline``.

        A higher attempt replaces a receiving one (its counts start over); re-expecting a lower or equal
        attempt, or any attempt of a fenced transfer, is a caller bug.
        """
        writers = frozenset(writer_ranks)
        if not writers or min(writers) < 0:
            raise ValueError(
                f"{transfer_id}: writer ranks must be a non-empty set of non-negative ranks, got "
                f"{sorted(writers)}"
            )
        current = self._pending.get(transfer_id)
        if current is not None and (attempt <= current.attempt or current.failure is not None):
            raise ValueError(
                f"{transfer_id}: attempt {attempt} does not supersede pending attempt {current.attempt}"
            )
        if current is None and len(self._pending) >= self.max_pending:
            raise ValueError(f"{transfer_id}: {self.max_pending} transfers already pending")
        self._pending[transfer_id] = _Expectation(attempt, writers, deadline)
        self._deadlines.push(deadline, transfer_id)

    def on_message(self, message: Message, now: float) -> bool:
        """Route a decoded notification; registrations and aborts are not for decode and count as ignored."""
        if isinstance(message, CompletionMessage):
            return self.on_completion(message)
        if isinstance(message, FailureMessage):
            return self.on_failure(message, now)
        return False

    def on_completion(self, message: CompletionMessage) -> bool:
        """Count a completion; returns whether it counted (False: stale, duplicate or unexpected)."""
        expectation = self._pending.get(message.transfer_id)
        if expectation is None or message.attempt != expectation.attempt:
            return False
        if message.prefill_rank not in expectation.writers or message.prefill_rank in expectation.arrived:
            return False
        expectation.arrived.add(message.prefill_rank)
        expectation.quiet.add(message.prefill_rank)
        expectation.bytes_written += message.bytes_written
        if expectation.failure is None and expectation.arrived == expectation.writers:
            del self._pending[message.transfer_id]
            self._finished.append(
                ReceivedTransfer(message.transfer_id, message.attempt, expectation.bytes_written)
            )
        else:
            self._release_if_quiet(message.transfer_id, expectation)
        return True

    def on_failure(self, message: FailureMessage, now: float) -> bool:
        """A writer of the current attempt gave up (and is quiet): fence the transfer; returns whether it
        counted."""
        expectation = self._pending.get(message.transfer_id)
        if (
            expectation is None
            or message.attempt != expectation.attempt
            or message.rank not in expectation.writers
        ):
            return False
        expectation.quiet.add(message.rank)
        if expectation.failure is None:
            failure = TransferFailure(
                message.transfer_id, message.attempt, message.side, message.reason, message.detail
            )
            self._fence(message.transfer_id, expectation, failure, now)
        else:
            self._release_if_quiet(message.transfer_id, expectation)
        return True

    def cancel(self, transfer_id: str, reason: FailureReason, detail: str, now: float) -> bool:
        """Decode gives up (the request was aborted, a registration could not be sent): fence the transfer.
        Returns whether it was receiving."""
        expectation = self._pending.get(transfer_id)
        if expectation is None or expectation.failure is not None:
            return False
        self._fence(
            transfer_id,
            expectation,
            TransferFailure(transfer_id, expectation.attempt, EngineRole.DECODE, reason, detail),
            now,
        )
        return True

    def withdraw(self, transfer_id: str) -> None:
        """Forget a receiving transfer no writer was told about (its registration reached none of them):
        nothing can land in its blocks, so nothing is fenced or reported."""
        expectation = self._pending.get(transfer_id)
        if expectation is not None and expectation.failure is None and not expectation.arrived:
            del self._pending[transfer_id]

    def writers_gone(self, transfer_id: str, now: float, *, grace_s: float) -> bool:
        """The writers' engine is known gone (nobody listens, or a new incarnation does): a dead process posts
        nothing, so the fence ends ``grace_s`` from now (for bytes already on the wire). Returns whether it
        was fenced."""
        expectation = self._pending.get(transfer_id)
        if expectation is None or expectation.failure is None:
            return False
        if now + grace_s < expectation.fence_until:
            expectation.fence_until = now + grace_s
            self._deadlines.push(expectation.fence_until, transfer_id)
        return True

    def poll(self, now: float) -> PollResult:
        """Transfers that ended since the last poll, and the aborts to send: deadlines and fences ``<= now``
        apply first."""
        for transfer_id in self._deadlines.due(now):
            expectation = self._pending.get(transfer_id)
            if expectation is None or expectation.due() > now:
                continue
            if expectation.failure is None:
                missing = sorted(expectation.writers - expectation.arrived)
                detail = f"no completion from prefill ranks {missing} by the deadline"
                failure = TransferFailure(
                    transfer_id, expectation.attempt, EngineRole.DECODE, FailureReason.TIMEOUT, detail
                )
                self._fence(transfer_id, expectation, failure, now)
            else:
                self._release(
                    transfer_id,
                    expectation,
                    unconfirmed=tuple(sorted(expectation.writers - expectation.quiet)),
                )
        self._deadlines.compact(self._pending.__contains__, len(self._pending))
        # a transfer released since it failed needs no announcement: its end is in `failed`
        failing = tuple(failure for failure in self._failing if failure.transfer_id in self._fenced)
        result = PollResult(tuple(self._finished), tuple(self._failed), tuple(self._aborts), failing)
        self._finished.clear()
        self._failed.clear()
        self._aborts.clear()
        self._failing.clear()
        return result

    def _fence(
        self, transfer_id: str, expectation: _Expectation, failure: TransferFailure, now: float
    ) -> None:
        expectation.failure = failure
        self._fenced.add(transfer_id)
        # A live writer may post until the registration's lifetime ends, which decode's deadline marks.
        expectation.fence_until = max(now, expectation.deadline) + self.fence_s
        noisy = tuple(sorted(expectation.writers - expectation.quiet))
        if noisy:
            self._aborts.append(
                AbortWriters(transfer_id, expectation.attempt, noisy, f"{failure.reason}: {failure.detail}")
            )
            self._deadlines.push(expectation.fence_until, transfer_id)
            self._failing.append(failure)
        self._release_if_quiet(transfer_id, expectation)

    def _release_if_quiet(self, transfer_id: str, expectation: _Expectation) -> None:
        if expectation.failure is not None and expectation.quiet >= expectation.writers:
            self._release(transfer_id, expectation, unconfirmed=())

    def _release(self, transfer_id: str, expectation: _Expectation, *, unconfirmed: tuple[int, ...]) -> None:
        assert expectation.failure is not None
        del self._pending[transfer_id]
        self._fenced.discard(transfer_id)
        failure = expectation.failure
        self._failed.append(
            TransferFailure(
                failure.transfer_id,
                failure.attempt,
                failure.side,
                failure.reason,
                failure.detail,
                unconfirmed,
            )
        )
