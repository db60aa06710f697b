from typing import TypeVar

import pytest
from pdconnector.protocol.messages import AbortMessage, FailureReason
from pdconnector.protocol.pairing import PrefillBlocks, paired_blocks
from pdconnector.protocol.params import EngineRole
from pdconnector.protocol.rendezvous import (
    AbandonWrite,
    Closed,
    Event,
    NotifyDecode,
    Outcome,
    RendezvousLimits,
    RendezvousTable,
    StartWrite,
    WriteKey,
)

LIMITS = RendezvousLimits(
    max_entries=8,
    registration_lease_s=10.0,
    prefill_lease_s=100.0,
    write_timeout_s=5.0,
    tombstone_ttl_s=1000.0,
    registration_lifetime_s=500.0,
)
BLOCKS = ((1, 2, 3),)
BLOCK_SIZE = 16
T = TypeVar("T")


def table(prefill_rank: int = 0, prefill_tp: int = 1, **kwargs) -> RendezvousTable:
    kwargs.setdefault("block_size", BLOCK_SIZE)
    return RendezvousTable(
        prefill_rank=prefill_rank, prefill_tp_size=prefill_tp, limits=kwargs.pop("limits", LIMITS), **kwargs
    )


def only(events: list[Event], kind: type[T]) -> T:
    assert len(events) == 1, events
    assert isinstance(events[0], kind), events
    return events[0]


def kinds(events: list[Event]) -> list[type]:
    return [type(event) for event in events]


DECODE_AGENT = "decode-0-rank0"  # the agent name the registration factory gives decode rank 0


def abort(transfer_id: str = "tx-1", attempt: int = 0) -> AbortMessage:
    return AbortMessage(transfer_id=transfer_id, attempt=attempt, decode_rank=0, detail="client went away")


# --- pairing in either order ------------------------------------------------------------------


def test_registration_then_prefill_starts_the_write_when_prefill_finishes(registration):
    rendezvous = table()
    assert rendezvous.registration_received(registration(), now=0.0) == []
    start = only(rendezvous.prefill_finished("tx-1", BLOCKS, num_tokens=48, now=1.0), StartWrite)
    assert start.key == WriteKey("tx-1", 0, 0)
    assert start.registration == registration()
    assert start.prefill == PrefillBlocks("tx-1", BLOCKS, 48)
    assert start.deadline == 1.0 + LIMITS.write_timeout_s


def test_prefill_then_registration_starts_the_write_when_the_registration_arrives(registration):
    rendezvous = table()
    assert rendezvous.prefill_finished("tx-1", BLOCKS, num_tokens=48, now=0.0) == []
    start = only(rendezvous.registration_received(registration(), now=2.0), StartWrite)
    assert start.key == WriteKey("tx-1", 0, 0)
    assert start.deadline == 2.0 + LIMITS.write_timeout_s


def test_a_completed_write_closes_the_transfer_and_releases_the_blocks_once(registration):
    rendezvous = table()
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    start = only(rendezvous.registration_received(registration(), now=0.0), StartWrite)
    closed = only(rendezvous.write_done(start.key, now=1.0), Closed)
    assert (closed.outcome, closed.blocks) == (Outcome.WRITTEN, start.prefill)
    assert "tx-1" not in rendezvous
    assert len(rendezvous) == 0
    assert rendezvous.write_done(start.key, now=1.0) == []
    assert rendezvous.expire(now=10_000.0) == []


def test_a_closed_transfer_says_where_its_time_went_on_this_rank(registration):
    rendezvous = table()
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=1.0)
    start = only(rendezvous.registration_received(registration(), now=1.25), StartWrite)
    closed = only(rendezvous.write_done(start.key, now=1.75), Closed)
    assert closed.stages == {"registration": 0.25, "post": 0.0, "write": 0.5, "hold": 0.75}


def test_transfers_are_paired_by_transfer_id_only(registration):
    rendezvous = table()
    rendezvous.prefill_finished("tx-a", BLOCKS, 48, now=0.0)
    assert rendezvous.registration_received(registration("tx-b"), now=0.0) == []
    start = only(rendezvous.registration_received(registration("tx-a"), now=0.0), StartWrite)
    assert start.prefill.transfer_id == "tx-a"
    assert len(rendezvous) == 2


# --- decode's prefix-cache hit (cached_blocks) ------------------------------------------------

# vLLM's group order for a hybrid model here: attention group 0, SSM group 1 (already reduced to its state
# block).
HYBRID_PREFILL = PrefillBlocks("tx-1", ((1, 2, 3, 4, 5), (9,)), 5 * BLOCK_SIZE - 3)
SSM_GROUPS = frozenset({1})


def test_prefill_skips_the_blocks_decode_holds_and_writes_the_rest_one_for_one(registration):
    """Prefill computed 5 blocks; decode holds the first 2 from its prefix cache and registers 3 for the
    rest."""
    rendezvous = table()
    rendezvous.prefill_finished("tx-1", ((1, 2, 3, 4, 5),), 5 * BLOCK_SIZE - 3, now=0.0)
    start = only(
        rendezvous.registration_received(registration(block_ids=((30, 31, 32),), cached_blocks=2), now=0.0),
        StartWrite,
    )
    # the tokens those 3 blocks hold
    assert start.prefill == PrefillBlocks("tx-1", ((3, 4, 5),), 3 * BLOCK_SIZE - 3)
    closed = only(rendezvous.write_done(start.key, now=1.0), Closed)
    # every held block is released
    assert closed.blocks == PrefillBlocks("tx-1", ((1, 2, 3, 4, 5),), 5 * BLOCK_SIZE - 3)


def test_the_offset_applies_to_attention_groups_only_and_ssm_state_moves_whole(registration):
    hit = registration(block_ids=((30, 31, 32), (40,)), cached_blocks=2)
    paired = paired_blocks(HYBRID_PREFILL, hit, block_size=BLOCK_SIZE, ssm_groups=SSM_GROUPS)
    assert paired == PrefillBlocks("tx-1", ((3, 4, 5), (9,)), 3 * BLOCK_SIZE - 3)


def test_without_a_prefix_hit_the_pairing_is_the_prefill_blocks_unchanged(registration):
    miss = registration(block_ids=((30, 31, 32, 33, 34), (40,)))
    assert paired_blocks(HYBRID_PREFILL, miss, block_size=BLOCK_SIZE, ssm_groups=SSM_GROUPS) == HYBRID_PREFILL


MISFITS = {  # registration's block_ids, its cached_blocks, what decode is told
    "too-few-after-the-offset": (
        ((30, 31), (40,)),
        2,
        "block_ids[0]: decode rank 0 registered 2 blocks, prefill has 5 blocks of which decode holds the "
        "first 2",
    ),
    "offset-not-applied": (
        ((30, 31, 32, 33, 34), (40,)),
        2,
        "block_ids[0]: decode rank 0 registered 5 blocks",
    ),
    "ssm-group-offset": (
        ((30, 31, 32), (40, 41)),
        2,
        "block_ids[1]: decode rank 0 registered 2 blocks, prefill has 1 state blocks",
    ),
    "more-cached-than-computed": (
        ((), (40,)),
        6,
        "cached_blocks: decode rank 0 holds 6 blocks of KV group 0, prefill has only 5",
    ),
    "every-token-cached": (
        ((), (40,)),
        5,
        "cached_blocks: decode rank 0 holds 80 tokens, prefill computed only 77",
    ),
}


@pytest.mark.parametrize(("block_ids", "cached", "detail"), MISFITS.values(), ids=MISFITS.keys())
def test_a_registration_that_does_not_fit_the_prefill_blocks_after_the_offset_fails_clearly(
    registration, block_ids, cached, detail
):
    rendezvous = table(ssm_groups=SSM_GROUPS)
    rendezvous.prefill_finished("tx-1", HYBRID_PREFILL.block_ids, HYBRID_PREFILL.num_tokens, now=0.0)
    events = rendezvous.registration_received(
        registration(block_ids=block_ids, cached_blocks=cached), now=0.0
    )
    assert kinds(events) == [NotifyDecode, Closed]
    assert events[0].message.reason is FailureReason.INVALID_REGISTRATION
    assert events[0].message.detail.startswith(detail), events[0].message.detail
    assert events[1].blocks == HYBRID_PREFILL  # freed, nothing written


# --- duplicates and attempts ------------------------------------------------------------------


def test_a_duplicate_registration_is_ignored_before_and_after_pairing(registration):
    rendezvous = table()
    assert rendezvous.registration_received(registration(), now=0.0) == []
    assert rendezvous.registration_received(registration(), now=0.5) == []
    only(rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=1.0), StartWrite)
    assert rendezvous.registration_received(registration(), now=1.5) == []


def test_a_higher_attempt_before_pairing_replaces_the_old_registration(registration):
    rendezvous = table()
    rendezvous.registration_received(registration(attempt=1, block_ids=((7, 8, 9),)), now=0.0)
    rendezvous.registration_received(registration(attempt=2, block_ids=((20, 21, 22),)), now=1.0)
    start = only(rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=2.0), StartWrite)
    assert start.key.attempt == 2
    assert start.registration.block_ids == ((20, 21, 22),)


def test_a_lower_attempt_is_ignored(registration):
    rendezvous = table()
    rendezvous.registration_received(registration(attempt=3), now=0.0)
    assert rendezvous.registration_received(registration(attempt=2, block_ids=((99,),)), now=0.0) == []
    start = only(rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0), StartWrite)
    assert start.key.attempt == 3


def test_reregistration_after_preemption_rewrites_and_the_stale_write_never_completes_the_new_attempt(
    registration,
):
    rendezvous = table()
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    first = only(rendezvous.registration_received(registration(attempt=0), now=0.0), StartWrite)
    # Decode was preempted while the first WRITE was in flight and registered fresh blocks.
    second = only(
        rendezvous.registration_received(registration(attempt=1, block_ids=((40, 41, 42),)), now=1.0),
        StartWrite,
    )
    assert second.key == WriteKey("tx-1", 1, 0)
    # the stale write completing does not finish attempt 1
    assert rendezvous.write_done(first.key, now=2.0) == []
    assert "tx-1" in rendezvous
    closed = only(rendezvous.write_done(second.key, now=3.0), Closed)
    assert closed.outcome is Outcome.WRITTEN
    assert "attempt 1" in closed.detail


def test_after_a_stale_write_completes_the_new_attempt_can_still_fail(registration):
    rendezvous = table()
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    first = only(rendezvous.registration_received(registration(attempt=0), now=0.0), StartWrite)
    second = only(rendezvous.registration_received(registration(attempt=1), now=1.0), StartWrite)
    rendezvous.write_done(first.key, now=2.0)
    events = rendezvous.write_failed(second.key, "remote disconnect", now=3.0)
    assert kinds(events) == [NotifyDecode, Closed]
    assert events[0].message.attempt == 1
    assert events[1].outcome is Outcome.FAILED


def test_blocks_stay_held_until_a_stale_write_still_reading_them_ends(registration):
    rendezvous = table()
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    first = only(rendezvous.registration_received(registration(attempt=0), now=0.0), StartWrite)
    second = only(rendezvous.registration_received(registration(attempt=1), now=1.0), StartWrite)
    # attempt 1 written, but attempt 0's WRITE still reads the blocks
    assert rendezvous.write_done(second.key, now=2.0) == []
    # a stale failure does not fail the transfer
    closed = only(rendezvous.write_failed(first.key, "peer reset", now=3.0), Closed)
    assert closed.outcome is Outcome.WRITTEN


def test_a_resent_registration_after_success_is_silently_ignored(registration):
    rendezvous = table()
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    start = only(rendezvous.registration_received(registration(), now=0.0), StartWrite)
    rendezvous.write_done(start.key, now=1.0)
    assert rendezvous.registration_received(registration(), now=2.0) == []


def test_a_new_attempt_after_the_transfer_ended_is_told_at_once(registration):
    rendezvous = table()
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    start = only(rendezvous.registration_received(registration(), now=0.0), StartWrite)
    rendezvous.write_done(start.key, now=1.0)
    notify = only(rendezvous.registration_received(registration(attempt=1), now=2.0), NotifyDecode)
    assert (notify.message.reason, notify.message.attempt) == (FailureReason.ALREADY_CLOSED, 1)


# --- leases -----------------------------------------------------------------------------------


def test_finished_blocks_without_a_registration_expire_at_the_lease_and_are_freed(registration):
    rendezvous = table()
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    assert rendezvous.next_deadline() == LIMITS.registration_lease_s
    assert rendezvous.expire(now=LIMITS.registration_lease_s - 0.001) == []
    # no decode known: nobody to notify
    closed = only(rendezvous.expire(now=LIMITS.registration_lease_s), Closed)
    assert closed.outcome is Outcome.EXPIRED
    assert closed.blocks == PrefillBlocks("tx-1", BLOCKS, 48)
    assert "decode did not register" in closed.detail
    assert len(rendezvous) == 0


def test_a_registration_arriving_after_expiry_is_failed_at_once(registration):
    rendezvous = table()
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    rendezvous.expire(now=100.0)
    notify = only(rendezvous.registration_received(registration(), now=101.0), NotifyDecode)
    assert notify.message.reason is FailureReason.ALREADY_CLOSED
    assert "expired" in notify.message.detail
    assert len(rendezvous) == 0


def test_a_lost_prefill_expires_the_registration_and_tells_decode(registration):
    rendezvous = table()
    rendezvous.registration_received(registration(), now=0.0)
    assert rendezvous.expire(now=LIMITS.prefill_lease_s - 1) == []
    events = rendezvous.expire(now=LIMITS.prefill_lease_s)
    assert kinds(events) == [NotifyDecode, Closed]
    notify, closed = events
    assert notify.agent == registration().agent_name
    assert notify.message.side is EngineRole.PREFILL
    assert notify.message.reason is FailureReason.LEASE_EXPIRED
    assert (closed.outcome, closed.blocks) == (Outcome.EXPIRED, None)


def test_a_prefill_finishing_after_its_registration_expired_is_freed_at_once(registration):
    rendezvous = table()
    rendezvous.registration_received(registration(), now=0.0)
    rendezvous.expire(now=LIMITS.prefill_lease_s)
    closed = only(rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=LIMITS.prefill_lease_s + 1), Closed)
    assert (closed.outcome, closed.blocks) == (Outcome.EXPIRED, PrefillBlocks("tx-1", BLOCKS, 48))
    assert len(rendezvous) == 0


def test_a_new_attempt_renews_the_lease_on_held_blocks(registration):
    rendezvous = table(prefill_tp=1)
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    # Decode TP 2: rank 0 registers attempt 0, then both ranks are preempted; rank 0 registers attempt 1 at
    # t=8.
    first = only(
        rendezvous.registration_received(registration(attempt=0, decode_rank=0, decode_tp=2), now=1.0),
        StartWrite,
    )
    rendezvous.write_done(first.key, now=2.0)
    second = only(
        rendezvous.registration_received(registration(attempt=1, decode_rank=0, decode_tp=2), now=8.0),
        StartWrite,
    )
    rendezvous.write_done(second.key, now=9.0)
    # the old lease (t=10) no longer applies
    assert not any(isinstance(event, Closed) for event in rendezvous.expire(now=12.0))
    events = rendezvous.expire(now=18.0)
    assert isinstance(events[-1], Closed)


def test_a_write_past_its_deadline_is_cancelled_and_decode_told_only_once_the_cancel_is_confirmed(
    registration,
):
    rendezvous = table()
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    start = only(rendezvous.registration_received(registration(), now=0.0), StartWrite)
    assert rendezvous.expire(now=start.deadline - 0.01) == []
    assert only(rendezvous.expire(now=start.deadline), AbandonWrite).key == start.key
    # asked once; blocks still pinned, decode not told yet
    assert rendezvous.expire(now=start.deadline + 1) == []
    events = rendezvous.write_failed(start.key, "cancelled", now=start.deadline + 2)
    assert kinds(events) == [NotifyDecode, Closed]
    assert events[0].message.reason is FailureReason.WRITE_TIMEOUT
    assert (events[1].outcome, events[1].blocks) == (Outcome.FAILED, start.prefill)
    # the ended write's late result is ignored
    assert rendezvous.write_done(start.key, now=start.deadline + 3) == []


def test_a_write_that_cannot_be_cancelled_keeps_the_blocks_until_it_really_ends(registration):
    rendezvous = table()
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    start = only(rendezvous.registration_received(registration(), now=0.0), StartWrite)
    only(rendezvous.expire(now=start.deadline), AbandonWrite)
    assert rendezvous.expire(now=start.deadline + 1000) == []  # no lease frees blocks a write may still read
    assert "tx-1" in rendezvous
    events = rendezvous.write_done(start.key, now=start.deadline + 1001)
    assert kinds(events) == [NotifyDecode, Closed]
    assert events[1].outcome is Outcome.FAILED  # landed too late to count: decode was past its deadline


def test_a_registration_is_not_written_after_its_lifetime_measured_on_receipt(registration):
    rendezvous = table()
    rendezvous.registration_received(registration(lifetime_ms=2000), now=10.0)
    events = rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=12.0)
    assert kinds(events) == [NotifyDecode, Closed]
    assert events[0].message.reason is FailureReason.LEASE_EXPIRED
    assert "lifetime" in events[0].message.detail
    assert (events[1].outcome, events[1].blocks) == (Outcome.EXPIRED, PrefillBlocks("tx-1", BLOCKS, 48))


def test_a_registration_whose_lifetime_ends_before_the_prefill_is_answered_at_that_moment(registration):
    rendezvous = table()
    rendezvous.registration_received(registration(lifetime_ms=2000), now=10.0)
    assert rendezvous.next_deadline() == 12.0
    assert rendezvous.expire(now=11.9) == []
    events = rendezvous.expire(now=12.0)
    assert kinds(events) == [NotifyDecode, Closed]
    assert events[1].blocks is None


def test_next_deadline_is_never_later_than_the_next_thing_to_expire(registration):
    rendezvous = table()
    assert rendezvous.next_deadline() is None
    rendezvous.registration_received(registration("tx-a"), now=0.0)
    rendezvous.prefill_finished("tx-b", BLOCKS, 48, now=5.0)
    assert rendezvous.next_deadline() == 5.0 + LIMITS.registration_lease_s
    rendezvous.expire(now=rendezvous.next_deadline())
    assert rendezvous.next_deadline() == LIMITS.prefill_lease_s


# --- failures ---------------------------------------------------------------------------------


def test_a_failed_write_tells_decode_and_frees_the_blocks(registration):
    rendezvous = table()
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    start = only(rendezvous.registration_received(registration(), now=0.0), StartWrite)
    events = rendezvous.write_failed(start.key, "NIXL_ERR_REMOTE_DISCONNECT", now=1.0)
    assert kinds(events) == [NotifyDecode, Closed]
    assert events[0].message.reason is FailureReason.WRITE_FAILED
    assert "NIXL_ERR_REMOTE_DISCONNECT" in events[0].message.detail
    assert (events[1].outcome, events[1].blocks) == (Outcome.FAILED, start.prefill)


def test_after_one_destination_fails_the_blocks_wait_for_the_other_write_in_flight(registration):
    rendezvous = table(prefill_tp=1)  # decode TP 2: this prefill rank writes decode ranks 0 and 1
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    to_0 = only(
        rendezvous.registration_received(registration(decode_rank=0, decode_tp=2), now=0.0), StartWrite
    )
    to_1 = only(
        rendezvous.registration_received(registration(decode_rank=1, decode_tp=2), now=0.0), StartWrite
    )
    # rank 1 is told once nothing writes into it
    assert rendezvous.write_failed(to_0.key, "boom", now=1.0) == []
    events = rendezvous.write_done(to_1.key, now=2.0)
    assert kinds(events) == [NotifyDecode, NotifyDecode, Closed]
    assert {event.agent for event in events[:2]} == {"decode-0-rank0", "decode-0-rank1"}
    assert events[2].outcome is Outcome.FAILED


def test_a_local_cancel_tells_every_registered_decode_rank(registration):
    rendezvous = table()
    rendezvous.registration_received(registration(), now=0.0)
    events = rendezvous.cancel("tx-1", "prefill request aborted", now=1.0)
    assert kinds(events) == [NotifyDecode, Closed]
    assert events[0].message.reason is FailureReason.CANCELLED
    assert events[1].outcome is Outcome.CANCELLED


def test_a_decode_abort_before_prefill_finishes_is_answered_at_once_and_frees_the_blocks_when_it_does(
    registration,
):
    rendezvous = table()
    ack = only(rendezvous.abort_received(abort(), now=0.0, sender=DECODE_AGENT), NotifyDecode)
    assert (ack.agent, ack.message.reason, ack.message.attempt) == (DECODE_AGENT, FailureReason.CANCELLED, 0)
    closed = only(rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=5.0), Closed)
    assert (closed.outcome, closed.blocks) == (Outcome.CANCELLED, PrefillBlocks("tx-1", BLOCKS, 48))
    assert len(rendezvous) == 0


def test_a_decode_abort_during_a_write_is_answered_once_the_write_ended(registration):
    rendezvous = table()
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    start = only(rendezvous.registration_received(registration(), now=0.0), StartWrite)
    # decode keeps its blocks meanwhile
    assert rendezvous.abort_received(abort(), now=1.0, sender=DECODE_AGENT) == []
    events = rendezvous.write_done(start.key, now=2.0)
    assert kinds(events) == [NotifyDecode, Closed]
    assert (events[0].agent, events[0].message.reason) == (DECODE_AGENT, FailureReason.CANCELLED)
    assert events[1].outcome is Outcome.CANCELLED


def test_an_abort_of_a_superseded_attempt_is_ignored(registration):
    rendezvous = table()
    rendezvous.registration_received(registration(attempt=2), now=0.0)
    assert rendezvous.abort_received(abort(attempt=1), now=0.0, sender=DECODE_AGENT) == []
    only(rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=1.0), StartWrite)


# --- incompatible or misrouted registrations --------------------------------------------------


@pytest.mark.parametrize(
    ("prefill", "decode", "reason"),
    [
        ((0, 2), (0, 3), FailureReason.INCOMPATIBLE),  # neither TP size divides the other
        (
            (1, 2),
            (0, 4),
            FailureReason.INVALID_REGISTRATION,
        ),  # prefill rank 1 of 2 writes decode ranks 2 and 3 of 4
        ((2, 4), (0, 2), FailureReason.INVALID_REGISTRATION),  # prefill rank 2 of 4 writes decode rank 1 of 2
    ],
)
def test_a_registration_this_rank_cannot_serve_is_refused_without_opening_an_entry(
    registration, prefill, decode, reason
):
    (prefill_rank, prefill_tp), (decode_rank, decode_tp) = prefill, decode
    rendezvous = table(prefill_rank=prefill_rank, prefill_tp=prefill_tp)
    notify = only(
        rendezvous.registration_received(registration(decode_rank=decode_rank, decode_tp=decode_tp), now=0.0),
        NotifyDecode,
    )
    assert notify.message.reason is reason
    assert notify.message.rank == prefill_rank
    assert len(rendezvous) == 0


def test_registrations_are_accepted_from_exactly_the_decode_ranks_this_rank_writes(registration):
    # decode TP 4: prefill rank 1 writes decode ranks 2 and 3
    rendezvous = table(prefill_rank=1, prefill_tp=2)
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    starts = [
        only(
            rendezvous.registration_received(registration(decode_rank=rank, decode_tp=4), now=0.0), StartWrite
        )
        for rank in (2, 3)
    ]
    assert [start.key.decode_rank for start in starts] == [2, 3]
    assert rendezvous.write_done(starts[0].key, now=1.0) == []
    assert only(rendezvous.write_done(starts[1].key, now=1.0), Closed).outcome is Outcome.WRITTEN


def test_several_prefill_ranks_each_write_their_chunk_into_one_decode_rank(registration):
    for prefill_rank in range(4):
        rendezvous = table(prefill_rank=prefill_rank, prefill_tp=4)
        rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
        start = only(
            rendezvous.registration_received(
                registration(decode_rank=prefill_rank // 2, decode_tp=2), now=0.0
            ),
            StartWrite,
        )
        assert only(rendezvous.write_done(start.key, now=1.0), Closed).outcome is Outcome.WRITTEN


def test_a_missing_decode_rank_expires_the_transfer_and_tells_the_ranks_that_registered(registration):
    rendezvous = table(prefill_tp=1)
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    start = only(
        rendezvous.registration_received(registration(decode_rank=0, decode_tp=2), now=0.0), StartWrite
    )
    assert rendezvous.write_done(start.key, now=1.0) == []  # decode rank 1 never registers
    events = rendezvous.expire(now=LIMITS.registration_lease_s)
    assert kinds(events) == [NotifyDecode, Closed]
    assert events[0].agent == "decode-0-rank0"
    assert events[1].outcome is Outcome.EXPIRED


def test_a_layout_fingerprint_mismatch_is_refused(registration):
    rendezvous = table(layout_fingerprint="llama-2l-f32-bs16")
    notify = only(
        rendezvous.registration_received(registration(layout_fingerprint="llama-2l-bf16-bs16"), now=0.0),
        NotifyDecode,
    )
    assert notify.message.reason is FailureReason.INCOMPATIBLE
    assert (
        rendezvous.registration_received(
            registration("tx-2", layout_fingerprint="llama-2l-f32-bs16"), now=0.0
        )
        == []
    )
    # unspecified: not compared
    assert rendezvous.registration_received(registration("tx-3", layout_fingerprint=""), now=0.0) == []
    assert len(rendezvous) == 2


def test_a_kv_group_count_mismatch_fails_the_transfer_and_frees_the_blocks(registration):
    rendezvous = table()
    rendezvous.prefill_finished("tx-1", ((1, 2), (3, 4)), 32, now=0.0)
    events = rendezvous.registration_received(registration(block_ids=((5, 6),)), now=0.0)
    assert kinds(events) == [NotifyDecode, Closed]
    assert events[0].message.reason is FailureReason.INCOMPATIBLE
    assert events[1].blocks is not None


def test_a_block_count_mismatch_fails_the_transfer_before_any_write_naming_both_counts(registration):
    rendezvous = table()
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    events = rendezvous.registration_received(registration(block_ids=((10, 11),)), now=0.0)
    assert kinds(events) == [NotifyDecode, Closed]
    assert events[0].message.reason is FailureReason.INVALID_REGISTRATION
    assert (
        events[0].message.detail
        == "block_ids[0]: decode rank 0 registered 2 blocks, prefill has 3 blocks of which decode holds the "
        "first 0"
    )
    assert events[1].blocks == PrefillBlocks("tx-1", BLOCKS, 48)


def test_decode_ranks_disagreeing_on_the_tp_size_fail_the_transfer(registration):
    rendezvous = table(prefill_rank=0, prefill_tp=2)
    rendezvous.registration_received(registration(decode_rank=0, decode_tp=4), now=0.0)
    events = rendezvous.registration_received(registration(decode_rank=0, decode_tp=2), now=0.0)
    assert events == []  # same attempt, same rank: a duplicate, ignored whatever it says
    events = rendezvous.registration_received(registration(decode_rank=1, decode_tp=2), now=0.0)
    assert kinds(events) == [NotifyDecode, NotifyDecode, Closed]
    assert {event.message.reason for event in events[:2]} == {FailureReason.INVALID_REGISTRATION}


# --- capacity and caller errors ---------------------------------------------------------------


def test_a_full_table_rejects_new_transfers_clearly_and_stays_bounded(registration):
    rendezvous = table(limits=RendezvousLimits(max_entries=2))
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    rendezvous.registration_received(registration("tx-2"), now=0.0)
    closed = only(rendezvous.prefill_finished("tx-3", BLOCKS, 48, now=0.0), Closed)
    assert (closed.outcome, closed.blocks) == (Outcome.REJECTED, PrefillBlocks("tx-3", BLOCKS, 48))
    assert "full" in closed.detail
    notify = only(rendezvous.registration_received(registration("tx-4"), now=0.0), NotifyDecode)
    assert notify.message.reason is FailureReason.CAPACITY
    assert len(rendezvous) == 2
    # existing transfers still pair
    assert only(rendezvous.registration_received(registration("tx-1"), now=0.0), StartWrite)


def test_reporting_a_prefill_finished_twice_is_a_caller_bug():
    rendezvous = table()
    rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)
    with pytest.raises(ValueError, match="twice"):
        rendezvous.prefill_finished("tx-1", BLOCKS, 48, now=0.0)


def test_the_table_refuses_a_rank_outside_its_tp_size():
    with pytest.raises(ValueError, match="rank 2"):
        RendezvousTable(prefill_rank=2, prefill_tp_size=2, block_size=BLOCK_SIZE)


def test_failure_notifications_carry_the_destination_attempt_and_the_prefill_rank(registration):
    rendezvous = table(prefill_rank=1, prefill_tp=2)
    rendezvous.registration_received(registration(attempt=4, decode_rank=0, decode_tp=1), now=0.0)
    notify = rendezvous.cancel("tx-1", "shutdown", now=0.0)[0]
    assert isinstance(notify, NotifyDecode)
    assert notify.agent == registration().agent_name
    assert (notify.message.transfer_id, notify.message.attempt, notify.message.rank) == ("tx-1", 4, 1)
