"""Decode-side completion counting: a transfer is received when every prefill rank that writes it said so.

One tracker per decode TP rank. ``expect`` is called when this rank registers an
attempt, with the prefill ranks that will write into it
(``layout.plan.writers_for``) and a deadline. Completions count distinct
expected ranks of the current attempt only: duplicates, strangers and stale
attempts are ignored, so a WRITE that belonged to an attempt decode already
replaced never completes the new one. A ``FailureMessage`` for the current attempt
fails the transfer at once; the deadline fails it otherwise. ``poll`` reports each
transfer's end exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pdconnector.protocol.deadlines import DeadlineQueue
from pdconnector.protocol.messages import CompletionMessage, FailureMessage, FailureReason, Message, Side


@dataclass(frozen=True)
class TransferFailure:
    transfer_id: str
    attempt: int
    side: Side  # who gave up: the prefill side (notified) or decode itself (deadline)
    reason: FailureReason
    detail: str


@dataclass(frozen=True)
class ReceivedTransfer:
    transfer_id: str
    attempt: int
    bytes_written: int  # summed over the writers' completion messages


@dataclass(frozen=True)
class PollResult:
    finished: tuple[ReceivedTransfer, ...] = ()
    failed: tuple[TransferFailure, ...] = ()

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
    bytes_written: int = 0


class CompletionTracker:
    def __init__(self, *, max_pending: int = 65536) -> None:
        self.max_pending = max_pending
        self._pending: dict[str, _Expectation] = {}
        self._finished: list[ReceivedTransfer] = []
        self._failed: list[TransferFailure] = []
        self._deadlines: DeadlineQueue[str] = DeadlineQueue()

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._pending

    def next_deadline(self) -> float | None:
        return self._deadlines.earliest()

    def expect(self, transfer_id: str, attempt: int, writer_ranks: Iterable[int], deadline: float) -> None:
        """Wait for one completion from each of ``writer_ranks`` for ``attempt`` by ``deadline``.

        A higher attempt replaces the pending one (its counts start over); re-expecting a lower or equal attempt is a caller bug.
        """
        writers = frozenset(writer_ranks)
        if not writers or min(writers) < 0:
            raise ValueError(f"{transfer_id}: writer ranks must be a non-empty set of non-negative ranks, got {sorted(writers)}")
        current = self._pending.get(transfer_id)
        if current is not None and attempt <= current.attempt:
            raise ValueError(f"{transfer_id}: attempt {attempt} does not supersede pending attempt {current.attempt}")
        if current is None and len(self._pending) >= self.max_pending:
            raise ValueError(f"{transfer_id}: {self.max_pending} transfers already pending")
        self._pending[transfer_id] = _Expectation(attempt, writers, deadline)
        self._deadlines.push(deadline, transfer_id)

    def on_message(self, message: Message) -> bool:
        """Route a decoded notification; registrations and aborts are not for decode and count as ignored."""
        if isinstance(message, CompletionMessage):
            return self.on_completion(message)
        if isinstance(message, FailureMessage):
            return self.on_failure(message)
        return False

    def on_completion(self, message: CompletionMessage) -> bool:
        """Count a completion; returns whether it counted (False: stale, duplicate or unexpected)."""
        expectation = self._pending.get(message.transfer_id)
        if expectation is None or message.attempt != expectation.attempt:
            return False
        if message.prefill_rank not in expectation.writers or message.prefill_rank in expectation.arrived:
            return False
        expectation.arrived.add(message.prefill_rank)
        expectation.bytes_written += message.bytes_written
        if expectation.arrived == expectation.writers:
            del self._pending[message.transfer_id]
            self._finished.append(ReceivedTransfer(message.transfer_id, message.attempt, expectation.bytes_written))
        return True

    def on_failure(self, message: FailureMessage) -> bool:
        """Fail the transfer if the message is about its current attempt; returns whether it did."""
        expectation = self._pending.get(message.transfer_id)
        if expectation is None or message.attempt != expectation.attempt:
            return False
        del self._pending[message.transfer_id]
        self._failed.append(TransferFailure(message.transfer_id, message.attempt, message.side, message.reason, message.detail))
        return True

    def cancel(self, transfer_id: str) -> int | None:
        """Stop waiting (decode aborted the request); returns the attempt to put in an ``AbortMessage``, if one was pending."""
        expectation = self._pending.pop(transfer_id, None)
        return None if expectation is None else expectation.attempt

    def poll(self, now: float) -> PollResult:
        """Transfers that ended since the last poll: all writers completed, a failure arrived, or the deadline passed."""
        for transfer_id in self._deadlines.due(now):
            expectation = self._pending.get(transfer_id)
            if expectation is None or expectation.deadline > now:
                continue
            del self._pending[transfer_id]
            missing = sorted(expectation.writers - expectation.arrived)
            detail = f"no completion from prefill ranks {missing} by the deadline"
            self._failed.append(TransferFailure(transfer_id, expectation.attempt, Side.DECODE, FailureReason.TIMEOUT, detail))
        self._deadlines.compact(self._pending.__contains__, len(self._pending))
        result = PollResult(tuple(self._finished), tuple(self._failed))
        self._finished.clear()
        self._failed.clear()
        return result
