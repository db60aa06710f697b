import pytest
from pdconnector.layout.plan import writers_for
from pdconnector.protocol.completion import CompletionTracker, ReceivedTransfer
from pdconnector.protocol.messages import CompletionMessage, FailureMessage, FailureReason, Side


def completion(rank: int, attempt: int = 0, transfer_id: str = "tx-1", nbytes: int = 100, tp: int = 4) -> CompletionMessage:
    return CompletionMessage(transfer_id=transfer_id, attempt=attempt, prefill_rank=rank, prefill_tp_size=tp, bytes_written=nbytes)


def failure(attempt: int = 0, reason: FailureReason = FailureReason.WRITE_FAILED, transfer_id: str = "tx-1") -> FailureMessage:
    return FailureMessage(transfer_id=transfer_id, attempt=attempt, side=Side.PREFILL, rank=1, reason=reason, detail="remote disconnect")


@pytest.fixture
def tracker() -> CompletionTracker:
    tracker = CompletionTracker()
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


def test_a_failure_notification_fails_the_transfer_at_the_next_poll(tracker):
    tracker.on_completion(completion(2))
    assert tracker.on_failure(failure())
    result = tracker.poll(now=0.5)  # long before the deadline
    assert result.failed_ids == {"tx-1"}
    (failed,) = result.failed
    assert (failed.side, failed.reason, failed.attempt) == (Side.PREFILL, FailureReason.WRITE_FAILED, 0)
    assert "remote disconnect" in failed.detail
    assert not tracker.on_completion(completion(3))  # too late: already failed
    assert tracker.poll(now=0.6).finished == ()


def test_a_failure_for_a_superseded_attempt_is_ignored(tracker):
    tracker.expect("tx-1", attempt=1, writer_ranks=(2, 3), deadline=20.0)
    assert not tracker.on_failure(failure(attempt=0))
    assert tracker.poll(now=1.0).failed == ()
    assert "tx-1" in tracker


def test_a_failure_after_the_transfer_finished_is_ignored(tracker):
    tracker.on_completion(completion(2))
    tracker.on_completion(completion(3))
    assert not tracker.on_failure(failure())
    result = tracker.poll(now=1.0)
    assert (result.finished_ids, result.failed) == ({"tx-1"}, ())


def test_a_transfer_times_out_at_its_deadline_naming_the_missing_ranks(tracker):
    tracker.on_completion(completion(2))
    assert tracker.next_deadline() == 10.0
    assert tracker.poll(now=9.99).failed == ()
    (failed,) = tracker.poll(now=10.0).failed
    assert (failed.side, failed.reason) == (Side.DECODE, FailureReason.TIMEOUT)
    assert "[3]" in failed.detail
    assert len(tracker) == 0


def test_a_new_attempt_brings_its_own_deadline(tracker):
    tracker.expect("tx-1", attempt=1, writer_ranks=(2, 3), deadline=30.0)
    assert tracker.poll(now=10.0).failed == ()  # the first attempt's deadline no longer applies
    assert tracker.poll(now=30.0).failed_ids == {"tx-1"}


def test_cancel_stops_waiting_and_returns_the_attempt_to_abort(tracker):
    assert tracker.cancel("tx-1") == 0
    assert tracker.cancel("tx-1") is None
    assert not tracker.on_completion(completion(2))
    assert tracker.poll(now=100.0) == type(tracker.poll(now=0.0))()


def test_on_message_routes_completions_and_failures_and_ignores_the_rest(tracker):
    assert tracker.on_message(completion(2))
    assert tracker.on_message(failure())
    assert tracker.poll(now=0.0).failed_ids == {"tx-1"}


def test_expecting_a_stale_attempt_or_no_writers_is_a_caller_bug(tracker):
    with pytest.raises(ValueError, match="supersede"):
        tracker.expect("tx-1", attempt=0, writer_ranks=(2, 3), deadline=1.0)
    with pytest.raises(ValueError, match="non-empty"):
        tracker.expect("tx-2", attempt=0, writer_ranks=(), deadline=1.0)


def test_the_tracker_is_bounded():
    tracker = CompletionTracker(max_pending=1)
    tracker.expect("tx-1", 0, (0,), deadline=1.0)
    with pytest.raises(ValueError, match="already pending"):
        tracker.expect("tx-2", 0, (0,), deadline=1.0)
    tracker.expect("tx-1", 1, (0,), deadline=1.0)  # replacing an attempt does not need room


def test_many_transfers_are_tracked_independently():
    tracker = CompletionTracker()
    for index in range(5):
        tracker.expect(f"tx-{index}", 0, (0,), deadline=float(index))
    tracker.on_completion(completion(0, transfer_id="tx-4", tp=1))
    tracker.on_failure(failure(transfer_id="tx-3"))
    result = tracker.poll(now=1.5)
    assert result.finished_ids == {"tx-4"}
    assert result.failed_ids == {"tx-0", "tx-1", "tx-3"}
    assert "tx-2" in tracker
    assert len(tracker) == 1
