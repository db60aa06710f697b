"""Prefill's pull-mode holds: blocks wait for every decode rank that READs them, a plain abort or the
lease."""

from __future__ import annotations

import pytest
from pdconnector.protocol.messages import AbortMessage, ProtocolError, ReadDoneMessage, decode, encode
from pdconnector.protocol.pairing import PrefillBlocks
from pdconnector.protocol.pull import PullHolds
from pdconnector.protocol.rendezvous import Outcome

BLOCKS = PrefillBlocks("tx-1", ((1, 2),), 20)


def holds(rank: int = 0, tp: int = 1) -> PullHolds:
    table = PullHolds(prefill_rank=rank, prefill_tp_size=tp, lease_s=10.0)
    table.hold(BLOCKS, now=0.0)
    return table


def read_done_message(
    transfer_id: str, attempt: int, decode_rank: int, decode_tp_size: int
) -> ReadDoneMessage:
    return ReadDoneMessage(
        transfer_id=transfer_id,
        attempt=attempt,
        decode_rank=decode_rank,
        decode_tp_size=decode_tp_size,
        bytes_read=64,
    )


def test_read_done_names_decode_tp_and_round_trips() -> None:
    message = decode(encode(read_done_message("tx-1", 0, 3, 4)))
    assert isinstance(message, ReadDoneMessage) and (message.decode_rank, message.decode_tp_size) == (3, 4)
    with pytest.raises(ProtocolError, match="decode_rank"):
        read_done_message("tx-1", 0, 4, 4)


def test_blocks_are_released_once_every_reading_decode_rank_is_done() -> None:
    table = holds(rank=1, tp=2)  # decode TP 4: prefill rank 1 is read by decode ranks 2 and 3
    assert table.notice_received(read_done_message("tx-1", 0, 2, 4), now=1.0) is None
    # not one of this rank's readers
    assert table.notice_received(read_done_message("tx-1", 0, 0, 4), now=1.0) is None
    released = table.notice_received(read_done_message("tx-1", 0, 3, 4), now=1.5)
    assert released is not None and released.outcome is Outcome.WRITTEN and released.blocks == BLOCKS
    assert released.stages == {"hold": 1.5}  # held from the prefill's end to the last reader's notice
    assert "tx-1" not in table


def test_one_reader_suffices_when_decode_tp_is_smaller() -> None:
    table = holds(rank=3, tp=4)
    released = table.notice_received(read_done_message("tx-1", 0, 1, 2), now=1.0)
    assert released is not None and released.outcome is Outcome.WRITTEN


def test_a_plain_abort_releases_at_once() -> None:
    released = holds().notice_received(
        AbortMessage(transfer_id="tx-1", attempt=0, decode_rank=0, detail="READ failed"), now=1.0
    )
    assert released is not None and released.outcome is Outcome.CANCELLED and "READ failed" in released.detail


def test_the_lease_releases_unread_blocks() -> None:
    table = holds()
    assert table.expire(9.9) == []
    (released,) = table.expire(10.0)
    assert released.outcome is Outcome.EXPIRED and len(table) == 0


def test_unknown_transfers_and_double_holds() -> None:
    table = holds()
    assert table.notice_received(read_done_message("tx-other", 0, 0, 1), now=1.0) is None
    assert len(table) == 1
    assert table.cancel("tx-other", "x", now=0.0) is None
    with pytest.raises(ValueError, match="reported finished twice"):
        table.hold(BLOCKS, now=1.0)


def test_a_read_done_that_overtakes_its_hold_releases_the_blocks_when_the_hold_arrives() -> None:
    table = PullHolds(prefill_rank=0, prefill_tp_size=1, lease_s=10.0)
    assert table.notice_received(read_done_message("tx-1", 0, 0, 1), now=0.0) is None
    assert table.early_count() == 1
    released = table.hold(BLOCKS, now=0.5)
    assert released is not None and released.outcome is Outcome.WRITTEN and released.blocks == BLOCKS
    assert len(table) == 0 and table.early_count() == 0


def test_early_notices_count_per_reader_and_an_early_abort_releases_too() -> None:
    table = PullHolds(prefill_rank=1, prefill_tp_size=2, lease_s=10.0)
    table.notice_received(read_done_message("tx-1", 0, 2, 4), now=0.0)
    assert table.hold(BLOCKS, now=0.1) is None  # decode rank 3 has not read yet
    released = table.notice_received(read_done_message("tx-1", 0, 3, 4), now=0.2)
    assert released is not None and released.outcome is Outcome.WRITTEN
    table.notice_received(
        AbortMessage(transfer_id="tx-2", attempt=0, decode_rank=0, detail="READ failed"), now=0.3
    )
    released = table.hold(PrefillBlocks("tx-2", ((3,),), 5), now=0.4)
    assert released is not None and released.outcome is Outcome.CANCELLED and "READ failed" in released.detail


def test_early_notices_are_forgotten_after_a_lease_and_bounded_in_number() -> None:
    table = PullHolds(prefill_rank=0, prefill_tp_size=1, lease_s=10.0, max_early=3)
    for index in range(5):
        table.notice_received(read_done_message(f"tx-{index}", 0, 0, 1), now=float(index))
    assert table.early_count() == 3
    assert table.hold(PrefillBlocks("tx-0", ((1,),), 5), now=5.0) is None  # evicted: the lease covers it
    table.expire(now=12.5)
    assert table.early_count() == 2  # tx-2's notice (t=2) is older than a lease; tx-3, tx-4 remain
    assert table.hold(PrefillBlocks("tx-4", ((2,),), 5), now=13.0) is not None
