"""Faults, in-process over MockTransport: each ends in a reported failure within its deadline, every held
block is released (a ``finished_sending`` result on prefill), the peer is told when an answer is possible,
nothing hangs and nothing is written outside the requested blocks (decode pools and guard bytes checked). A
hand-driven decode agent sends the registrations a healthy decode worker never would."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
from pdconnector.layout import RankLayout
from pdconnector.protocol.messages import (
    MAGIC,
    PROTOCOL_VERSION,
    CompletionMessage,
    FailureMessage,
    Message,
    RegistrationMessage,
    decode,
)
from pdconnector.transport.base import MemoryRegion
from pdconnector.transport.mock import MockTransport
from pdconnector.worker import EngineInfo, RankInfo, fetch_engine_info, layout_summary
from pdconnector.worker.side_channel import SideChannelServer

from tests.pdconnector.worker.engines import (
    DECODE_FILL,
    GUARD_BYTES,
    GUARD_FILL,
    MODELS,
    Engine,
    request_blocks,
)
from tests.ports import free_port

NUM_BLOCKS = 16
TOKENS = 40  # three logical blocks of the dense model
SRC = [[3, 4, 5]]
DST = [[7, 1, 9]]


class RawDecodeAgent:
    """Decode rank 0 of a TP-1 engine, driven by hand from the test thread: one guarded pool region per layout
    region."""

    def __init__(self, name: str, model: str = "dense") -> None:
        self.layout = RankLayout(MODELS[model], 1, 0, NUM_BLOCKS)
        self.buffers = [
            np.full(r.nbytes + 2 * GUARD_BYTES, GUARD_FILL, dtype=np.uint8) for r in self.layout.regions
        ]
        for buffer in self.buffers:
            buffer[GUARD_BYTES:-GUARD_BYTES] = DECODE_FILL
        self.addresses = tuple(b[GUARD_BYTES:].ctypes.data for b in self.buffers)
        self.transport = MockTransport(name)
        self.transport.register(
            [
                MemoryRegion(addr, r.nbytes)
                for addr, r in zip(self.addresses, self.layout.regions, strict=True)
            ]
        )
        self.name = name
        self.prefill_agent = ""

    def handshake(self, coords: dict[str, Any]) -> None:
        """Announce this agent through prefill's side channel and load prefill rank 0."""
        metadata = self.transport.metadata()
        me = RankInfo(
            tp_rank=0,
            agent_name=self.name,
            agent_metadata=metadata,
            region_base_addresses=self.addresses,
            num_blocks=NUM_BLOCKS,
        )
        announce = EngineInfo(
            engine_id=f"{self.name}-engine", tp_size=1, layout=layout_summary(self.layout.model), ranks=(me,)
        )
        info = fetch_engine_info(coords["host"], coords["side_channel_port"], timeout_s=5, announce=announce)
        self.prefill_agent = self.transport.add_peer(info.ranks[0].agent_metadata)

    def registration(self, transfer_id: str, **overrides: Any) -> dict[str, Any]:
        fields = {
            "type": "register",
            "transfer_id": transfer_id,
            "attempt": 0,
            "decode_engine_id": f"{self.name}-engine",
            "decode_host": "127.0.0.1",
            "decode_port": 5600,
            "decode_tp_rank": 0,
            "decode_tp_size": 1,
            "num_tokens": TOKENS,
            "num_blocks": NUM_BLOCKS,
            "block_ids": tuple(map(tuple, DST)),
            "agent_name": self.name,
            "region_base_addresses": self.addresses,
        }
        return fields | overrides

    def send(self, fields: dict[str, Any]) -> None:
        """Frame ``fields`` as the protocol does, without its validation (the point is to send what it would
        refuse)."""
        self.transport.notify(
            self.prefill_agent, MAGIC + bytes([PROTOCOL_VERSION]) + msgspec.msgpack.encode(fields)
        )

    def receive(self, timeout_s: float, count: int = 1) -> list[Message]:
        deadline = time.monotonic() + timeout_s
        messages: list[Message] = []
        while time.monotonic() < deadline and len(messages) < count:
            messages += [decode(frame) for _, frame in self.transport.take_notifications()]
            time.sleep(0.005)
        return messages

    def untouched(self) -> bool:
        return all(
            bool((b[:GUARD_BYTES] == GUARD_FILL).all() and (b[-GUARD_BYTES:] == GUARD_FILL).all())
            for b in self.buffers
        )

    def close(self) -> None:
        self.transport.close()


@pytest.fixture
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, Engine, dict[str, Any]]]:
    limits = getattr(request, "param", None)
    prefill = Engine("prefill-f", "dense", tp=1, num_blocks=NUM_BLOCKS, transport="mock", limits=limits)
    decode = Engine("decode-f", "dense", tp=1, num_blocks=NUM_BLOCKS, transport="mock")
    try:
        coords = prefill.start()
        decode.start()
        prefill.fill(blocks=SRC, num_tokens=TOKENS)
        yield prefill, decode, coords
    finally:
        decode.close()
        prefill.close()


@pytest.fixture
def raw_agent(engines: tuple[Engine, Engine, dict[str, Any]]) -> Iterator[RawDecodeAgent]:
    agent = RawDecodeAgent("raw-decode-r0")
    try:
        agent.handshake(engines[2])
        yield agent
    finally:
        agent.close()


def _timed_wait(engine: Engine, transfer_id: str, timeout_s: float) -> tuple[list[dict[str, Any]], float]:
    start = time.monotonic()
    results = engine.wait(transfer_id=transfer_id, timeout_s=timeout_s)
    return results, time.monotonic() - start


def _one(results: list[dict[str, Any]]) -> tuple[str, str]:
    assert len(results) == 1, results
    return results[0]["kind"], results[0]["outcome"]


# --- leases and deadlines -----------------------------------------------------------------------------------


@pytest.mark.parametrize("engines", [{"registration_lease_s": 0.5}], indirect=True)
def test_prefill_frees_its_blocks_when_no_registration_arrives_within_the_lease(
    engines: tuple[Engine, Engine, dict[str, Any]],
) -> None:
    prefill, _, _ = engines
    prefill.prefill_finished(transfer_id="tx-lost", blocks=SRC, num_tokens=TOKENS)
    results, elapsed = _timed_wait(prefill, "tx-lost", 5)
    assert _one(results) == ("finished_sending", "expired")
    assert 0.4 <= elapsed < 2.0
    assert "decode did not register" in results[0]["detail"]


def test_decode_fails_at_its_deadline_and_prefill_frees_blocks_of_the_abandoned_transfer(
    engines: tuple[Engine, Engine, dict[str, Any]],
) -> None:
    prefill, decode, coords = engines
    decode.expect_push(transfer_id="tx-slow", prefill=coords, blocks=DST, num_tokens=TOKENS, timeout_s=0.8)
    results, elapsed = _timed_wait(decode, "tx-slow", 5)
    assert _one(results) == ("failed_recving", "timeout")
    assert 0.7 <= elapsed < 2.5
    # Decode's abort reached prefill: a prefill finishing afterwards is released at once, nothing is written.
    assert prefill.wait_stat(name="registrations_received", value=1, timeout_s=1)
    time.sleep(0.2)
    prefill.prefill_finished(transfer_id="tx-slow", blocks=SRC, num_tokens=TOKENS)
    results, elapsed = _timed_wait(prefill, "tx-slow", 5)
    assert _one(results) == ("finished_sending", "cancelled") and elapsed < 2.0
    assert decode.check(received=[]) == {"wrong_bytes": 0, "guard_bytes": 0}


@pytest.mark.parametrize("engines", [{"registration_lease_s": 0.5}], indirect=True)
def test_pull_hold_is_released_when_nobody_reads_within_the_lease(
    engines: tuple[Engine, Engine, dict[str, Any]],
) -> None:
    prefill, _, _ = engines
    prefill.prefill_finished(transfer_id="tx-unread", blocks=SRC, num_tokens=TOKENS, pull=True)
    results, elapsed = _timed_wait(prefill, "tx-unread", 5)
    assert _one(results) == ("finished_sending", "expired") and 0.4 <= elapsed < 2.0


def test_decode_fails_promptly_when_the_prefill_side_channel_is_unreachable(
    engines: tuple[Engine, Engine, dict[str, Any]],
) -> None:
    _, decode, coords = engines
    with MockTransport("placeholder") as closed:  # a port that was just free: nobody listens on it afterwards
        port = closed.address[1]
    decode.expect_push(
        transfer_id="tx-nobody",
        prefill=coords | {"side_channel_port": port},
        blocks=DST,
        num_tokens=TOKENS,
        timeout_s=10,
    )
    results, elapsed = _timed_wait(decode, "tx-nobody", 5)
    # a peer that does not answer is unreachable, not incompatible (the router and the metrics say so)
    assert _one(results) == ("failed_recving", "unreachable") and elapsed < 2.0
    assert "unreachable" in results[0]["detail"]


# --- refused and failing registrations ----------------------------------------------------------------------


def test_malformed_registration_is_answered_with_a_failure_naming_the_field(
    engines: tuple[Engine, Engine, dict[str, Any]], raw_agent: RawDecodeAgent
) -> None:
    prefill, _, _ = engines
    raw_agent.send(raw_agent.registration("tx-bad", block_ids=[[7, NUM_BLOCKS + 3, 9]]))
    (answer,) = raw_agent.receive(timeout_s=3)
    assert isinstance(answer, FailureMessage) and answer.transfer_id == "tx-bad"
    assert answer.reason == "invalid_registration" and "block_ids[0][1]" in answer.detail
    assert prefill.stats()[0]["notifications_refused"] == 1
    assert raw_agent.untouched()


def test_oversized_registration_field_is_answered_with_a_failure(
    engines: tuple[Engine, Engine, dict[str, Any]], raw_agent: RawDecodeAgent
) -> None:
    raw_agent.send(raw_agent.registration("tx-huge", agent_metadata=b"x" * (300 << 10)))
    (answer,) = raw_agent.receive(timeout_s=3)
    assert (
        isinstance(answer, FailureMessage)
        and answer.reason == "invalid_registration"
        and "agent_metadata" in answer.detail
    )


def test_registration_pointing_outside_decode_memory_fails_both_sides_and_writes_nothing(
    engines: tuple[Engine, Engine, dict[str, Any]], raw_agent: RawDecodeAgent
) -> None:
    prefill, _, _ = engines
    shifted = [a + r.nbytes for a, r in zip(raw_agent.addresses, raw_agent.layout.regions, strict=True)]
    raw_agent.send(raw_agent.registration("tx-outside", region_base_addresses=shifted))
    prefill.prefill_finished(transfer_id="tx-outside", blocks=SRC, num_tokens=TOKENS)
    results, _ = _timed_wait(prefill, "tx-outside", 5)
    assert _one(results) == ("finished_sending", "failed")
    (answer,) = raw_agent.receive(timeout_s=3)
    assert isinstance(answer, FailureMessage) and answer.reason == "write_failed"
    assert raw_agent.untouched()
    assert all((b[GUARD_BYTES:-GUARD_BYTES] == DECODE_FILL).all() for b in raw_agent.buffers)


def test_duplicate_registration_is_written_once(
    engines: tuple[Engine, Engine, dict[str, Any]], raw_agent: RawDecodeAgent
) -> None:
    prefill, _, _ = engines
    registration = raw_agent.registration("tx-dup")
    raw_agent.send(registration)
    raw_agent.send(registration)
    assert prefill.wait_stat(name="registrations_received", value=2, timeout_s=3)
    prefill.prefill_finished(transfer_id="tx-dup", blocks=SRC, num_tokens=TOKENS)
    assert _one(prefill.wait(transfer_id="tx-dup", timeout_s=5)) == ("finished_sending", "written")
    messages = raw_agent.receive(timeout_s=0.5, count=2)
    assert [type(m) for m in messages] == [CompletionMessage]
    assert prefill.stats()[0]["writes_posted"] == 1
    assert raw_agent.untouched()


def test_a_registration_encoded_by_the_protocol_round_trips_through_the_raw_agent(
    raw_agent: RawDecodeAgent,
) -> None:
    """The raw agent's framing is the protocol's, so the refusals above are refusals of content, not of
    framing."""
    fields = raw_agent.registration("tx-same")
    typed = RegistrationMessage(**{k: v for k, v in fields.items() if k != "type"})
    assert decode(MAGIC + bytes([PROTOCOL_VERSION]) + msgspec.msgpack.encode(fields)) == typed


def test_prefill_block_ids_out_of_range_fail_the_transfer_promptly_on_both_sides(
    engines: tuple[Engine, Engine, dict[str, Any]],
) -> None:
    prefill, decode, coords = engines
    decode.expect_push(transfer_id="tx-range", prefill=coords, blocks=DST, num_tokens=TOKENS, timeout_s=20)
    assert prefill.wait_stat(name="registrations_received", value=1, timeout_s=5)
    prefill.prefill_finished(transfer_id="tx-range", blocks=[[3, 4, NUM_BLOCKS + 1]], num_tokens=TOKENS)
    assert _one(prefill.wait(transfer_id="tx-range", timeout_s=5)) == ("finished_sending", "failed")
    results, elapsed = _timed_wait(decode, "tx-range", 5)
    assert _one(results) == ("failed_recving", "write_failed") and elapsed < 2.0
    assert "out of range" in results[0]["detail"]
    assert decode.check(received=[]) == {"wrong_bytes": 0, "guard_bytes": 0}


def test_decode_block_ids_beyond_its_pool_fail_locally_at_once(
    engines: tuple[Engine, Engine, dict[str, Any]],
) -> None:
    prefill, decode, coords = engines
    decode.expect_push(
        transfer_id="tx-own", prefill=coords, blocks=[[7, 1, NUM_BLOCKS]], num_tokens=TOKENS, timeout_s=20
    )
    results, elapsed = _timed_wait(decode, "tx-own", 5)
    assert _one(results) == ("failed_recving", "invalid_registration") and elapsed < 2.0
    assert prefill.stats()[0].get("registrations_received", 0) == 0


def test_a_prefix_offset_that_does_not_fit_prefill_blocks_fails_both_sides_at_once_and_writes_nothing(
    engines: tuple[Engine, Engine, dict[str, Any]],
) -> None:
    """Decode says it holds 1 cached block but registers 3 more: prefill has 3 in all, so nothing lines up."""
    prefill, decode, coords = engines
    prefill.prefill_finished(transfer_id="tx-offset", blocks=SRC, num_tokens=TOKENS)
    decode.expect_push(
        transfer_id="tx-offset",
        prefill=coords,
        blocks=DST,
        num_tokens=TOKENS - 16,
        timeout_s=20,
        cached_blocks=1,
    )
    assert _one(prefill.wait(transfer_id="tx-offset", timeout_s=5)) == ("finished_sending", "failed")
    results, elapsed = _timed_wait(decode, "tx-offset", 5)
    assert _one(results) == ("failed_recving", "invalid_registration") and elapsed < 2.0
    assert (
        "block_ids[0]: decode rank 0 registered 3 blocks, prefill has 3 blocks of which decode holds the "
        "first 1" in results[0]["detail"]
    )
    assert prefill.stats()[0].get("writes_posted", 0) == 0
    assert decode.check(received=[]) == {"wrong_bytes": 0, "guard_bytes": 0}


def test_read_of_out_of_range_remote_blocks_fails_and_prefill_frees_at_once(
    engines: tuple[Engine, Engine, dict[str, Any]],
) -> None:
    prefill, decode, coords = engines
    prefill.prefill_finished(transfer_id="tx-read-range", blocks=SRC, num_tokens=TOKENS, pull=True)
    decode.read(
        transfer_id="tx-read-range",
        prefill=coords,
        remote_blocks=[[3, 4, 99]],
        blocks=DST,
        num_tokens=TOKENS,
        timeout_s=20,
    )
    assert _one(decode.wait(transfer_id="tx-read-range", timeout_s=5))[0] == "failed_recving"
    assert _one(prefill.wait(transfer_id="tx-read-range", timeout_s=5)) == ("finished_sending", "cancelled")
    assert decode.check(received=[]) == {"wrong_bytes": 0, "guard_bytes": 0}


def test_incompatible_decode_layout_fails_at_the_handshake_naming_what_differs(
    engines: tuple[Engine, Engine, dict[str, Any]],
) -> None:
    _, _, coords = engines
    decode = Engine("decode-wide", "dense_wide", tp=1, num_blocks=NUM_BLOCKS, transport="mock")
    try:
        decode.start()
        decode.expect_push(transfer_id="tx-wide", prefill=coords, blocks=DST, num_tokens=TOKENS, timeout_s=20)
        results, elapsed = _timed_wait(decode, "tx-wide", 5)
        assert _one(results) == ("failed_recving", "incompatible") and elapsed < 2.0
        assert "attention.head_dim: local 16 != remote 8" in results[0]["detail"]
    finally:
        decode.close()


def test_prefill_cancel_tells_a_registered_decode_at_once(
    engines: tuple[Engine, Engine, dict[str, Any]],
) -> None:
    prefill, decode, coords = engines
    decode.expect_push(transfer_id="tx-cancel", prefill=coords, blocks=DST, num_tokens=TOKENS, timeout_s=20)
    assert prefill.wait_stat(name="registrations_received", value=1, timeout_s=5)
    prefill.cancel(transfer_id="tx-cancel")
    results, elapsed = _timed_wait(decode, "tx-cancel", 5)
    assert _one(results) == ("failed_recving", "cancelled") and elapsed < 2.0
    prefill.prefill_finished(transfer_id="tx-cancel", blocks=SRC, num_tokens=TOKENS)
    assert _one(prefill.wait(transfer_id="tx-cancel", timeout_s=5)) == ("finished_sending", "cancelled")


# --- attempts -----------------------------------------------------------------------------------------------


def test_reregistration_after_preemption_writes_only_the_new_attempts_blocks(
    engines: tuple[Engine, Engine, dict[str, Any]],
) -> None:
    prefill, decode, coords = engines
    first, second = DST, [[11, 12, 13]]
    decode.expect_push(transfer_id="tx-pre", prefill=coords, blocks=first, num_tokens=TOKENS, timeout_s=20)
    assert prefill.wait_stat(name="registrations_received", value=1, timeout_s=5)
    decode.expect_push(
        transfer_id="tx-pre", prefill=coords, blocks=second, num_tokens=TOKENS, timeout_s=20, attempt=1
    )
    assert prefill.wait_stat(name="registrations_received", value=2, timeout_s=5)
    prefill.prefill_finished(transfer_id="tx-pre", blocks=SRC, num_tokens=TOKENS)
    assert _one(decode.wait(transfer_id="tx-pre", timeout_s=5)) == ("finished_recving", "received")
    assert _one(prefill.wait(transfer_id="tx-pre", timeout_s=5)) == ("finished_sending", "written")
    assert decode.check(received=[{"dst": second, "src": SRC, "num_tokens": TOKENS}]) == {
        "wrong_bytes": 0,
        "guard_bytes": 0,
    }


def test_repeating_the_same_attempt_sends_no_second_registration(
    engines: tuple[Engine, Engine, dict[str, Any]],
) -> None:
    prefill, decode, coords = engines
    for _ in range(2):
        decode.expect_push(
            transfer_id="tx-again", prefill=coords, blocks=DST, num_tokens=TOKENS, timeout_s=20
        )
    prefill.prefill_finished(transfer_id="tx-again", blocks=SRC, num_tokens=TOKENS)
    assert _one(decode.wait(transfer_id="tx-again", timeout_s=5)) == ("finished_recving", "received")
    assert prefill.stats()[0]["registrations_received"] == 1
    assert decode.check(received=[{"dst": DST, "src": SRC, "num_tokens": TOKENS}]) == {
        "wrong_bytes": 0,
        "guard_bytes": 0,
    }


# --- idle cost ----------------------------------------------------------------------------------------------


def test_idle_workers_burn_almost_no_cpu(engines: tuple[Engine, Engine, dict[str, Any]]) -> None:
    prefill, decode, coords = engines
    blocks = request_blocks(MODELS["dense"], NUM_BLOCKS, TOKENS, seed=5)
    decode.expect_push(transfer_id="tx-warm", prefill=coords, blocks=blocks, num_tokens=TOKENS, timeout_s=20)
    prefill.prefill_finished(transfer_id="tx-warm", blocks=SRC, num_tokens=TOKENS)
    assert _one(decode.wait(transfer_id="tx-warm", timeout_s=5))[0] == "finished_recving"
    assert decode.idle_cpu(seconds=2.0) < 0.3


def _served_then_restarted(
    prefill: Engine, decode: Engine, coords: dict[str, Any], *, port: int = 0
) -> Engine:
    """One push served by ``prefill``, then prefill restarted under the same engine id (new agents; its side
    channel at ``port``, 0: a new one), holding the same source blocks; decode's results cleared."""
    decode.expect_push(transfer_id="tx-before", prefill=coords, blocks=DST, num_tokens=TOKENS, timeout_s=10)
    prefill.prefill_finished(transfer_id="tx-before", blocks=SRC, num_tokens=TOKENS)
    assert _one(decode.wait(transfer_id="tx-before", timeout_s=5))[0] == "finished_recving"
    prefill.close()
    return Engine("prefill-f", "dense", tp=1, num_blocks=NUM_BLOCKS, transport="mock", side_channel_port=port)


def test_a_prefill_restarted_under_the_same_engine_id_is_handshaken_again_and_its_old_agent_dropped(
    engines: tuple[Engine, Engine, dict[str, Any]],
) -> None:
    prefill, decode, coords = engines
    restarted = _served_then_restarted(prefill, decode, coords)
    try:
        new_coords = restarted.start()
        restarted.fill(blocks=SRC, num_tokens=TOKENS)
        decode.reset()
        decode.expect_push(
            transfer_id="tx-after", prefill=new_coords, blocks=DST, num_tokens=TOKENS, timeout_s=10
        )
        restarted.prefill_finished(transfer_id="tx-after", blocks=SRC, num_tokens=TOKENS)
        assert _one(decode.wait(transfer_id="tx-after", timeout_s=5)) == ("finished_recving", "received")
        assert decode.check(received=[{"dst": DST, "src": SRC, "num_tokens": TOKENS}]) == {
            "wrong_bytes": 0,
            "guard_bytes": 0,
        }
        assert decode.transfers.workers[0].stats()["peers_dropped"] == 1
    finally:
        restarted.close()


def test_a_prefill_restarted_at_the_same_address_is_looked_up_again_when_the_registration_reaches_none(
    engines: tuple[Engine, Engine, dict[str, Any]],
) -> None:
    """Decode's cached handshake names the old start's agents; the registration reaches none of them, so it
    is withdrawn (nothing can land), the prefill looked up afresh and registered once more: served, not
    failed, and the registration counted once per delivery."""
    prefill, decode, started = engines
    coords = started | {"incarnation": ""}  # as a push's router names it: whichever start runs there
    port = coords["side_channel_port"]
    restarted = _served_then_restarted(prefill, decode, coords, port=port)
    try:
        assert restarted.start()["side_channel_port"] == port
        restarted.fill(blocks=SRC, num_tokens=TOKENS)
        decode.reset()
        decode.expect_push(transfer_id="tx-again", prefill=coords, blocks=DST, num_tokens=TOKENS, timeout_s=5)
        restarted.prefill_finished(transfer_id="tx-again", blocks=SRC, num_tokens=TOKENS)
        assert _one(decode.wait(transfer_id="tx-again", timeout_s=5)) == ("finished_recving", "received")
        stats = decode.transfers.workers[0].stats()
        assert (stats["prefills_looked_up_again"], stats["registrations_sent"]) == (1, 2)
    finally:
        restarted.close()


def test_a_handshake_answer_naming_agents_that_are_gone_is_looked_up_again_and_served(
    engines: tuple[Engine, Engine, dict[str, Any]],
) -> None:
    """The side channel answers with agents that no longer listen (a restarted engine's old ones, as a cached
    or racing answer names them): loading them fails as unreachable, not incompatible, and decode looks the
    engine up once more instead of failing the transfer (CI: a 502 after the router's retries ran out)."""
    prefill, decode, coords = engines
    live = fetch_engine_info(coords["host"], coords["side_channel_port"], timeout_s=5)
    gone = Engine("prefill-f", "dense", tp=1, num_blocks=NUM_BLOCKS, transport="mock")
    gone_coords = gone.start()
    stale = fetch_engine_info(gone_coords["host"], gone_coords["side_channel_port"], timeout_s=5)
    gone.close()  # its agent refuses connections from now on
    answers = iter([stale])
    with SideChannelServer("127.0.0.1", 0, engine_info=lambda: next(answers, live)) as server:
        via = coords | {"side_channel_port": server.port, "incarnation": ""}
        decode.expect_push(transfer_id="tx-stale", prefill=via, blocks=DST, num_tokens=TOKENS, timeout_s=5)
        prefill.prefill_finished(transfer_id="tx-stale", blocks=SRC, num_tokens=TOKENS)
        assert _one(decode.wait(transfer_id="tx-stale", timeout_s=5)) == ("finished_recving", "received")
    assert decode.transfers.workers[0].stats()["prefills_looked_up_again"] == 1


def test_a_pull_from_a_prefill_restarted_since_it_answered_fails_instead_of_reading_its_new_start() -> None:
    """The prefill answered with its blocks, then restarted under the same engine id and address: the READ
    must not go to the new start, whose same block ids hold other requests' KV (a silently wrong answer)."""
    port = free_port()
    first = Engine(
        "prefill-r", "dense", tp=1, num_blocks=NUM_BLOCKS, transport="mock", side_channel_port=port
    )
    decode = Engine("decode-r", "dense", tp=1, num_blocks=NUM_BLOCKS, transport="mock")
    try:
        coords = first.start()
        decode.start()
        first.fill(blocks=SRC, num_tokens=TOKENS)
        first.prefill_finished(transfer_id="tx-r", blocks=SRC, num_tokens=TOKENS, pull=True)
        first.close()
        second = Engine(
            "prefill-r", "dense", tp=1, num_blocks=NUM_BLOCKS, transport="mock", side_channel_port=port
        )
        try:
            assert second.start()["side_channel_port"] == port
            second.fill(blocks=SRC, num_tokens=TOKENS)  # what another request would have left there
            decode.read(
                transfer_id="tx-r",
                prefill=coords,
                remote_blocks=SRC,
                blocks=DST,
                num_tokens=TOKENS,
                timeout_s=10,
            )
            results, elapsed = _timed_wait(decode, "tx-r", timeout_s=10)
            assert _one(results)[0] == "failed_recving"
            assert "held by incarnation" in results[0]["detail"], results
            assert elapsed < 2.0, "fails at the handshake, not at the deadline"
            assert decode.check(received=[]) == {"wrong_bytes": 0, "guard_bytes": 0}
            assert second.stats()[0].get("notifications_refused", 0) == 0
        finally:
            second.close()
    finally:
        decode.close()
        first.close()
