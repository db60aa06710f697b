"""Doorbells: a peer's ring wakes a rank's transfer thread at once, so no transfer waits for a polling timer.

The unit part rings real UDP sockets. The worker part sets the idle poll to 10 s, far above every bound
asserted, so only a ring can explain a prompt answer from a prefill that holds blocks for a registration: the
registration, or decode's abort, reaching it.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from pdconnector.transport.nixl_transport import nixl_unavailable_reason
from pdconnector.worker.doorbell import RING, Doorbell, Ringer

from tests.pdconnector.worker.engines import MODELS, Engine, request_blocks

LOOPBACK = "127.0.0.1"


class Rings:
    def __init__(self) -> None:
        self.count = 0
        self.changed = threading.Condition()

    def __call__(self) -> None:
        with self.changed:
            self.count += 1
            self.changed.notify_all()

    def wait_for(self, count: int, timeout_s: float = 2.0) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.count >= count, timeout_s)


@pytest.fixture
def rings() -> Rings:
    return Rings()


@pytest.fixture
def doorbell(rings: Rings):
    bell = Doorbell(LOOPBACK, rings)
    yield bell
    bell.close()


def test_a_ring_wakes_the_owner(doorbell: Doorbell, rings: Rings) -> None:
    ringer = Ringer()
    assert ringer.ring(LOOPBACK, doorbell.port)
    assert rings.wait_for(1)
    ringer.close()


def test_rings_before_the_owner_answered_fold_into_one_wake_up(doorbell: Doorbell, rings: Rings) -> None:
    ringer = Ringer()
    for _ in range(50):
        ringer.ring(LOOPBACK, doorbell.port)
    assert rings.wait_for(1)
    time.sleep(0.2)
    assert rings.count == 1
    doorbell.answered()
    ringer.ring(LOOPBACK, doorbell.port)
    assert rings.wait_for(2)
    ringer.close()


def test_datagrams_that_are_not_rings_are_ignored(doorbell: Doorbell, rings: Rings) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
        stranger.sendto(b"GET / HTTP/1.1\r\n\r\n", (LOOPBACK, doorbell.port))
        stranger.sendto(RING + b"x", (LOOPBACK, doorbell.port))
    time.sleep(0.2)
    assert rings.count == 0


def test_close_returns_promptly_and_frees_the_port(rings: Rings) -> None:
    bell = Doorbell(LOOPBACK, rings)
    port = bell.port
    started = time.monotonic()
    bell.close()
    assert time.monotonic() - started < 1.0
    assert rings.count == 0  # its own wake-up ring is not passed on
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as reuse:
        reuse.bind((LOOPBACK, port))


def test_a_peer_known_by_host_name_is_not_rung_so_the_transfer_thread_never_waits_for_dns(
    doorbell: Doorbell, rings: Rings
) -> None:
    ringer = Ringer()
    assert not ringer.ring("localhost", doorbell.port)
    assert not ringer.ring("decode-0.decode.inference.svc", doorbell.port)
    time.sleep(0.2)
    assert rings.count == 0
    ringer.close()


def test_ringing_a_port_nobody_listens_on_does_not_raise() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind((LOOPBACK, 0))
        port = probe.getsockname()[1]
    ringer = Ringer()
    for _ in range(3):  # an ICMP port-unreachable from the first may surface on a later send
        ringer.ring(LOOPBACK, port)
    ringer.close()


# --- transfer workers that only a ring can wake -------------------------------------------------------------

IDLE_POLL_S = 10.0
# A ring costs a datagram and a thread wake-up (ms); the idle poll would take 10 s: the bound lies midway,
# clear of a loaded 2-core machine's stalls.
PROMPT_BOUND_S = 5.0


@pytest.fixture(params=["mock", "nixl"])
def transport(request: pytest.FixtureRequest) -> str:
    if request.param == "nixl" and (reason := nixl_unavailable_reason()) is not None:
        pytest.fail(f"NIXL must be importable here: {reason}")
    return request.param


def _pair(transport: str) -> tuple[Engine, Engine, dict]:
    options = {"idle_poll_max_s": IDLE_POLL_S}
    prefill = Engine(
        "prefill-bell", "dense", tp=1, num_blocks=32, transport=transport, worker_options=options
    )
    decode = Engine("decode-bell", "dense", tp=1, num_blocks=32, transport=transport, worker_options=options)
    coords = prefill.start()
    decode.start()
    decode.prewarm(coords)  # the handshake is done: what follows is notifications only
    time.sleep(0.3)  # both threads have gone idle on their 10 s wait
    return prefill, decode, coords


def test_a_push_between_idle_workers_completes_on_rings_not_on_the_idle_poll(transport: str) -> None:
    prefill, decode, coords = _pair(transport)
    try:
        num_tokens = MODELS["dense"].block_size * 4 + 3
        src, dst = (
            request_blocks(MODELS["dense"], 32, num_tokens, seed=1),
            request_blocks(MODELS["dense"], 32, num_tokens, seed=2),
        )
        prefill.fill(blocks=src, num_tokens=num_tokens)
        prefill.prefill_finished("tx-bell", src, num_tokens)
        time.sleep(0.3)  # prefill holds the blocks and sleeps: the registration must wake it
        started = time.monotonic()
        decode.expect_push("tx-bell", prefill=coords, blocks=dst, num_tokens=num_tokens, timeout_s=30)
        received = decode.wait("tx-bell", timeout_s=IDLE_POLL_S)
        elapsed = time.monotonic() - started
        assert [(r["kind"], r["outcome"]) for r in received] == [("finished_recving", "received")], received
        assert elapsed < PROMPT_BOUND_S, f"the push took {elapsed:.2f} s"
        assert received[0]["stages"].keys() == {"handshake", "kv_wait"}
        assert received[0]["stages"]["kv_wait"] < elapsed
        assert decode.check(received=[{"src": src, "dst": dst, "num_tokens": num_tokens}]) == {
            "wrong_bytes": 0,
            "guard_bytes": 0,
        }
        sent = prefill.wait("tx-bell", timeout_s=1)
        assert [(r["kind"], r["outcome"]) for r in sent] == [("finished_sending", "written")]
        assert sent[0]["stages"]["registration"] >= 0.3  # prefill finished first and waited for decode
        assert sent[0]["stages"].keys() == {"registration", "post", "write", "hold"}
        assert prefill.stats()[0]["doorbells_rung"] >= 1 and decode.stats()[0]["doorbells_rung"] >= 1
    finally:
        decode.close()
        prefill.close()


def test_an_abort_frees_an_idle_prefill_at_once(transport: str) -> None:
    prefill, decode, coords = _pair(transport)
    try:
        num_tokens = MODELS["dense"].block_size * 3
        src = request_blocks(MODELS["dense"], 32, num_tokens, seed=3)
        prefill.prefill_finished("tx-abandoned", src, num_tokens)
        time.sleep(0.3)  # prefill holds the blocks for a registration and sleeps
        started = time.monotonic()
        decode.abandon("tx-abandoned", prefill=coords)
        freed = prefill.wait("tx-abandoned", timeout_s=IDLE_POLL_S)
        elapsed = time.monotonic() - started
        assert [(r["kind"], r["outcome"]) for r in freed] == [("finished_sending", "cancelled")], freed
        assert elapsed < PROMPT_BOUND_S, f"prefill freed {elapsed:.2f} s after decode abandoned the transfer"
    finally:
        decode.close()
        prefill.close()
