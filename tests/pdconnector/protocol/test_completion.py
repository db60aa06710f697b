import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from pdconnector.layout.plan import writers_for
from pdconnector.protocol.completion import AbortWriters, CompletionTracker, PollResult, ReceivedTransfer
from pdconnector.protocol.messages import CompletionMessage, FailureMessage, FailureReason
from pdconnector.protocol.params import EngineRole


def completion(
    rank: int, attempt: int = 0, transfer_id: str = "tx-1", nbytes: int = 100, tp: int = 4
) -> CompletionMessage:
    return CompletionMessage(
        transfer_id=transfer_id, attempt=attempt, prefill_rank=rank, prefill_tp_size=tp, bytes_written=nbytes
    )


def failure(
    attempt: int = 0,
    reason: FailureReason = FailureReason.WRITE_FAILED,
    transfer_id: str = "tx-1",
    rank: int = 2,
) -> FailureMessage:
    return FailureMessage(
        transfer_id=transfer_id,
        attempt=attempt,
        side=EngineRole.PREFILL,
        rank=rank,
        reason=reason,
        detail="remote disconnect",
    )


FENCE_S = 50.0


@pytest.fixture
def tracker() -> CompletionTracker:
    tracker = CompletionTracker(fence_s=FENCE_S)
    # Prefill TP 4 into decode TP 2: decode rank 1 is written by prefill ranks 2 and 3.
    tracker.expect("tx-1", attempt=0, writer_ranks=writers_for(1, p_tp=4, d_tp=2), deadline=10.0)
    return tracker


def test_a_transfer_finishes_when_every_writing_rank_completed(tracker):
    assert tracker.on_completion(completion(2, nbytes=300))
    assert tracker.poll(now=1.0).finished == ()
    assert tracker.on_completion(completion(3, nbytes=200))
    result = tracker.poll(now=1.0)
    assert result.finished == (ReceivedTransfer("tx-1", 0, 500),)
    assert result.finished_ids == {"tx-1"}
    assert result.failed == ()
    assert "tx-1" not in tracker


def test_duplicate_completions_from_one_rank_count_once(tracker):
    assert tracker.on_completion(completion(2))
    assert not tracker.on_completion(completion(2))
    assert tracker.poll(now=1.0).finished == ()


def test_completions_from_ranks_that_do_not_write_this_rank_are_ignored(tracker):
    assert not tracker.on_completion(completion(0))
    assert not tracker.on_completion(completion(1))
    tracker.on_completion(completion(2))
    assert tracker.poll(now=1.0).finished == ()


def test_each_transfer_is_reported_exactly_once(tracker):
    tracker.on_completion(completion(2))
    tracker.on_completion(completion(3))
    assert tracker.poll(now=1.0).finished_ids == {"tx-1"}
    assert tracker.poll(now=100.0) == tracker.poll(now=200.0) == type(tracker.poll(now=0.0))()


def test_completions_of_a_superseded_attempt_never_complete_the_new_one(tracker):
    tracker.on_completion(completion(2, attempt=0))
    tracker.expect("tx-1", attempt=1, writer_ranks=(2, 3), deadline=20.0)  # preempted: counts start over
    assert not tracker.on_completion(completion(3, attempt=0))
    assert tracker.poll(now=1.0).finished == ()
    tracker.on_completion(completion(2, attempt=1))
    tracker.on_completion(completion(3, attempt=1))
    assert tracker.poll(now=1.0).finished == (ReceivedTransfer("tx-1", 1, 200),)


def test_a_failure_from_one_writer_fences_the_transfer_and_aborts_the_others(tracker):
    assert tracker.on_failure(failure(rank=2), now=0.5)
    result = tracker.poll(now=0.5)  # long before the deadline
    assert result.failed == ()  # rank 3 may still be writing into the blocks
    assert result.aborts == (AbortWriters("tx-1", 0, (3,), "write_failed: remote disconnect"),)
    assert tracker.fenced() == 1
    # rank 3's answer: nothing in flight
    assert tracker.on_failure(failure(rank=3, reason=FailureReason.CANCELLED), now=0.6)
    (failed,) = tracker.poll(now=0.6).failed
    assert (failed.side, failed.reason, failed.attempt, failed.unconfirmed) == (
        EngineRole.PREFILL,
        FailureReason.WRITE_FAILED,
        0,
        (),
    )
    assert "remote disconnect" in failed.detail
    assert tracker.fenced() == 0 and "tx-1" not in tracker


def test_a_fenced_transfer_is_announced_failing_once_so_its_request_can_be_answered_before_the_fence_ends(
    tracker,
):
    tracker.on_failure(failure(rank=2), now=0.5)
    (failing,) = tracker.poll(now=0.5).failing
    assert (failing.transfer_id, failing.reason) == ("tx-1", FailureReason.WRITE_FAILED)
    assert tracker.poll(now=0.6).failing == ()  # once
    assert tracker.fenced() == 1  # the blocks stay: rank 3 may still write
    tracker.poll(now=10.0)
    assert tracker.poll(now=10.0 + FENCE_S).failed_ids == {"tx-1"}


def test_a_failure_whose_writers_are_all_quiet_is_not_announced_failing_only_failed():
    tracker = CompletionTracker(fence_s=FENCE_S)
    tracker.expect("tx-1", 0, (0,), deadline=10.0)
    tracker.on_failure(failure(rank=0), now=1.0)
    result = tracker.poll(now=1.0)
    assert (result.failing, result.failed_ids) == ((), {"tx-1"})


def test_a_transfer_that_failed_and_went_quiet_between_two_polls_is_only_failed(tracker):
    tracker.on_failure(failure(rank=2), now=0.5)
    tracker.on_failure(failure(rank=3, reason=FailureReason.CANCELLED), now=0.6)
    result = tracker.poll(now=0.6)
    assert (result.failing, result.failed_ids) == ((), {"tx-1"})


def test_a_completion_during_the_fence_quiets_its_writer_but_does_not_finish_the_transfer(tracker):
    tracker.on_failure(failure(rank=2), now=0.5)
    assert tracker.on_completion(completion(3))  # landed, but the transfer already failed
    result = tracker.poll(now=0.6)
    assert result.finished == () and result.failed_ids == {"tx-1"}


def test_when_every_writer_already_answered_a_failure_is_reported_at_once():
    tracker = CompletionTracker(fence_s=FENCE_S)
    tracker.expect("tx-1", 0, (0,), deadline=10.0)
    tracker.on_failure(failure(rank=0), now=1.0)
    result = tracker.poll(now=1.0)
    assert result.failed_ids == {"tx-1"} and result.aborts == ()


def test_a_failure_for_a_superseded_attempt_or_from_a_stranger_is_ignored(tracker):
    tracker.expect("tx-1", attempt=1, writer_ranks=(2, 3), deadline=20.0)
    assert not tracker.on_failure(failure(attempt=0), now=1.0)
    assert not tracker.on_failure(failure(attempt=1, rank=0), now=1.0)
    assert tracker.poll(now=1.0).failed == ()
    assert "tx-1" in tracker


def test_a_failure_after_the_transfer_finished_is_ignored(tracker):
    tracker.on_completion(completion(2))
    tracker.on_completion(completion(3))
    assert not tracker.on_failure(failure(), now=1.0)
    result = tracker.poll(now=1.0)
    assert (result.finished_ids, result.failed) == ({"tx-1"}, ())


def test_at_the_deadline_the_silent_writers_are_aborted_and_the_blocks_kept_for_the_fence(tracker):
    tracker.on_completion(completion(2))
    assert tracker.next_deadline() == 10.0
    assert tracker.poll(now=9.99) == PollResult()
    result = tracker.poll(now=10.0)
    assert result.failed == ()
    (abort,) = result.aborts
    assert (abort.ranks, abort.attempt) == ((3,), 0) and "[3]" in abort.detail
    assert tracker.next_deadline() == 10.0 + FENCE_S
    assert tracker.poll(now=10.0 + FENCE_S - 0.01) == PollResult()
    (failed,) = tracker.poll(now=10.0 + FENCE_S).failed
    assert (failed.side, failed.reason, failed.unconfirmed) == (
        EngineRole.DECODE,
        FailureReason.TIMEOUT,
        (3,),
    )
    assert len(tracker) == 0


def test_the_answer_to_the_abort_ends_the_fence_early(tracker):
    tracker.poll(now=10.0)
    tracker.on_failure(failure(rank=2, reason=FailureReason.CANCELLED), now=10.1)
    assert tracker.poll(now=10.1).failed == ()
    tracker.on_failure(failure(rank=3, reason=FailureReason.CANCELLED), now=10.2)
    (failed,) = tracker.poll(now=10.2).failed
    assert (failed.reason, failed.unconfirmed) == (FailureReason.TIMEOUT, ())


def test_a_new_attempt_brings_its_own_deadline(tracker):
    tracker.expect("tx-1", attempt=1, writer_ranks=(2, 3), deadline=30.0)
    assert tracker.poll(now=10.0).aborts == ()  # the first attempt's deadline no longer applies
    assert tracker.poll(now=30.0).aborts[0].attempt == 1


def test_a_cancel_aborts_every_writer_and_fences_from_the_deadline_not_from_now(tracker):
    assert tracker.cancel("tx-1", FailureReason.CANCELLED, "client went away", now=1.0)
    assert not tracker.cancel("tx-1", FailureReason.CANCELLED, "again", now=2.0)
    result = tracker.poll(now=1.0)
    assert result.aborts == (AbortWriters("tx-1", 0, (2, 3), "cancelled: client went away"),)
    # a silent writer may post until the registration's lifetime ends
    assert tracker.poll(now=10.0 + FENCE_S - 0.01).failed == ()
    (failed,) = tracker.poll(now=10.0 + FENCE_S).failed
    assert (failed.side, failed.reason, failed.unconfirmed) == (
        EngineRole.DECODE,
        FailureReason.CANCELLED,
        (2, 3),
    )


def test_writers_known_gone_end_the_fence_after_the_grace(tracker):
    tracker.poll(now=10.0)
    assert tracker.writers_gone("tx-1", now=11.0, grace_s=1.0)
    assert tracker.poll(now=11.9).failed == ()
    (failed,) = tracker.poll(now=12.0).failed
    assert failed.unconfirmed == (2, 3)
    assert not tracker.writers_gone("tx-1", now=13.0, grace_s=1.0)


def test_a_transfer_no_writer_was_told_about_is_withdrawn_without_a_fence_or_a_report(tracker):
    tracker.withdraw("tx-1")
    assert "tx-1" not in tracker
    assert tracker.poll(now=10.0 + FENCE_S) == PollResult()


def test_a_transfer_a_writer_answered_or_that_is_fenced_cannot_be_withdrawn(tracker):
    tracker.on_completion(completion(2))
    tracker.withdraw("tx-1")
    assert "tx-1" in tracker
    tracker.cancel("tx-1", FailureReason.CANCELLED, "gone", now=1.0)
    tracker.withdraw("tx-1")
    assert tracker.is_fenced("tx-1")


def test_cancelling_an_unknown_transfer_does_nothing(tracker):
    assert not tracker.cancel("tx-9", FailureReason.CANCELLED, "gone", now=0.0)
    assert tracker.poll(now=0.0) == PollResult()


def test_on_message_routes_completions_and_failures_and_ignores_the_rest(tracker):
    assert tracker.on_message(completion(2), now=0.0)
    assert tracker.on_message(failure(rank=3), now=0.0)
    assert tracker.poll(now=0.0).failed_ids == {"tx-1"}


def test_expecting_a_stale_attempt_or_no_writers_is_a_caller_bug(tracker):
    with pytest.raises(ValueError, match="supersede"):
        tracker.expect("tx-1", attempt=0, writer_ranks=(2, 3), deadline=1.0)
    with pytest.raises(ValueError, match="non-empty"):
        tracker.expect("tx-2", attempt=0, writer_ranks=(), deadline=1.0)
    tracker.cancel("tx-1", FailureReason.CANCELLED, "gone", now=0.0)
    with pytest.raises(
        ValueError, match="supersede"
    ):  # a fenced transfer is not reused until its blocks are free
        tracker.expect("tx-1", attempt=1, writer_ranks=(2, 3), deadline=1.0)


def test_the_tracker_is_bounded():
    tracker = CompletionTracker(fence_s=FENCE_S, max_pending=1)
    tracker.expect("tx-1", 0, (0,), deadline=1.0)
    with pytest.raises(ValueError, match="already pending"):
        tracker.expect("tx-2", 0, (0,), deadline=1.0)
    tracker.expect("tx-1", 1, (0,), deadline=1.0)  # replacing an attempt does not need room


def test_many_transfers_are_tracked_independently():
    tracker = CompletionTracker(fence_s=0.0)
    for index in range(5):
        tracker.expect(f"tx-{index}", 0, (0,), deadline=float(index))
    tracker.on_completion(completion(0, transfer_id="tx-4", tp=1))
    tracker.on_failure(failure(transfer_id="tx-3", rank=0), now=0.0)
    result = tracker.poll(now=1.5)  # tx-0 and tx-1 time out, fenced for 0 s from their deadlines
    assert (result.finished_ids, result.failed_ids) == ({"tx-4"}, {"tx-0", "tx-1", "tx-3"})
    assert "tx-2" in tracker
    assert len(tracker) == 1


# --- every interleaving -------------------------------------------------------------------------------------

WRITERS = (0, 1)
DEADLINE = 10.0
MACHINE_FENCE_S = 5.0


class FenceMachine(RuleBasedStateMachine):
    """Completions, failures and abort answers from two writers, cancels and time, in any order. A writer may
    touch the blocks until it completed or answered; the tracker must not report the transfer's end before
    every writer did or the fence passed, and must report it exactly once, by deadline + fence at the
    latest."""

    def __init__(self) -> None:
        super().__init__()
        self.tracker = CompletionTracker(fence_s=MACHINE_FENCE_S)
        self.tracker.expect("tx", 0, WRITERS, deadline=DEADLINE)
        self.now = 0.0
        self.quiet: set[int] = set()
        self.completed: set[int] = set()
        self.failed_at: float | None = None
        self.reported = False

    def observe(self) -> None:
        result = self.tracker.poll(self.now)
        for abort in result.aborts:
            assert set(abort.ranks) == set(WRITERS) - self.quiet, (
                "aborted a writer that already answered, or missed one"
            )
        ended = [*result.finished, *result.failed]
        if not ended:
            return
        assert not self.reported, "reported twice"
        self.reported = True
        if result.finished:
            assert self.completed == set(WRITERS) and self.failed_at is None
            return
        (failure,) = result.failed
        fence_end = (
            max(self.failed_at if self.failed_at is not None else DEADLINE, DEADLINE) + MACHINE_FENCE_S
        )
        assert self.quiet >= set(WRITERS) or self.now >= fence_end, "released blocks a writer may still touch"
        assert set(failure.unconfirmed) == set(WRITERS) - self.quiet

    @rule(rank=st.sampled_from(WRITERS))
    def a_write_lands(self, rank: int) -> None:
        if self.tracker.on_completion(completion(rank, attempt=0, transfer_id="tx", tp=2)):
            self.quiet.add(rank)
            self.completed.add(rank)
        self.observe()

    @rule(rank=st.sampled_from(WRITERS))
    def a_writer_answers_with_a_failure(self, rank: int) -> None:
        if rank in self.completed:
            return  # prefill never fails a rank it completed
        if self.tracker.on_failure(failure(transfer_id="tx", rank=rank), now=self.now):
            self.quiet.add(rank)
            self.failed_at = (
                self.now if self.failed_at is None and self.completed != set(WRITERS) else self.failed_at
            )
        self.observe()

    @rule()
    def decode_cancels(self) -> None:
        if (
            self.tracker.cancel("tx", FailureReason.CANCELLED, "aborted", now=self.now)
            and self.failed_at is None
        ):
            self.failed_at = self.now
        self.observe()

    @rule(seconds=st.sampled_from([0.5, 2.0, 5.0, 9.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        if self.failed_at is None and not self.reported and self.now >= DEADLINE:
            self.failed_at = DEADLINE
        self.observe()

    @invariant()
    def nothing_outlives_deadline_plus_fence(self) -> None:
        if self.now >= DEADLINE + MACHINE_FENCE_S + 9.0:
            assert self.reported

    def teardown(self) -> None:
        # Two late polls: the first notices the deadline (the fence counts from then, as the aborts only leave
        # then).
        for _ in range(2):
            self.now = max(self.now, DEADLINE) + MACHINE_FENCE_S
            self.observe()
        assert self.reported and len(self.tracker) == 0, "blocks held forever"


def test_the_fence_holds_under_any_interleaving():
    run_state_machine_as_test(
        FenceMachine, settings=settings(max_examples=300, stateful_step_count=30, deadline=None)
    )
