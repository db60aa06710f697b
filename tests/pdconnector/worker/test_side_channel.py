"""The engine-level handshake: what the server serves, the client's cache and its invalidation when a peer
restarts, bounded and timed-out I/O, and clear refusals."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import msgspec
import pytest
from pdconnector.protocol.params import PrefillCoordinates, mint_incarnation
from pdconnector.worker import (
    EngineInfo,
    RankInfo,
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
    fetch_engine_info,
    layout_summary,
)
from pdconnector.worker.side_channel import MAGIC, MAX_FRAME_BYTES, PeerGone

from tests.pdconnector.worker.engines import MODELS


def engine_info(engine_id: str, tp: int = 2) -> EngineInfo:
    ranks = tuple(
        RankInfo(
            tp_rank=r,
            agent_name=f"{engine_id}-r{r}",
            agent_metadata=b"meta",
            region_base_addresses=(4096, 8192, 12288),
            num_blocks=16,
        )
        for r in range(tp)
    )
    return EngineInfo(engine_id=engine_id, tp_size=tp, layout=layout_summary(MODELS["dense"]), ranks=ranks)


class Served:
    """A server whose answer the test can swap (a restart) and which counts handshakes and announces."""

    def __init__(self, info: EngineInfo | None) -> None:
        self.info = info
        self.handshakes = 0
        self.announced: list[EngineInfo] = []
        self.server = SideChannelServer(
            "127.0.0.1", 0, engine_info=self.answer, on_announce=self.announced.append
        )

    def answer(self) -> EngineInfo:
        self.handshakes += 1
        if self.info is None:
            raise RuntimeError("engine still starting")
        return self.info

    def coords(self, engine_id: str, tp: int = 2) -> PrefillCoordinates:
        return PrefillCoordinates(engine_id, "127.0.0.1", self.server.port, tp)


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served(engine_info("prefill-a"))
    try:
        yield s
    finally:
        s.server.close()


@pytest.fixture
def client() -> Iterator[SideChannelClient]:
    c = SideChannelClient(announce=lambda: engine_info("decode-a", tp=1), timeout_s=1.0)
    try:
        yield c
    finally:
        c.close()


def test_handshake_returns_the_engine_and_delivers_the_announce(served: Served) -> None:
    announce = engine_info("decode-x", tp=1)
    assert fetch_engine_info("127.0.0.1", served.server.port, timeout_s=2, announce=announce) == served.info
    assert served.announced == [announce]


def test_client_caches_per_address_and_engine_id(served: Served, client: SideChannelClient) -> None:
    first = client.lookup(served.coords("prefill-a")).result(timeout=5)
    second = client.prewarm(served.coords("prefill-a")).result(timeout=5)
    assert first == second == served.info
    assert served.handshakes == 1


def test_a_restarted_peer_is_fetched_again_and_its_old_identity_refused(
    served: Served, client: SideChannelClient
) -> None:
    client.lookup(served.coords("prefill-a")).result(timeout=5)
    served.info = engine_info("prefill-a-restarted")  # same address, new pod incarnation
    assert (
        client.lookup(served.coords("prefill-a-restarted")).result(timeout=5).engine_id
        == "prefill-a-restarted"
    )
    with pytest.raises(SideChannelError, match="serves engine 'prefill-a-restarted', not 'prefill-a'"):
        client.lookup(served.coords("prefill-a")).result(timeout=5)


def test_a_lookup_naming_an_incarnation_gets_that_start_of_the_engine_or_peer_gone(
    served: Served, client: SideChannelClient
) -> None:
    first, second = mint_incarnation(), mint_incarnation()
    served.info = msgspec.structs.replace(engine_info("prefill-a"), incarnation=first)
    any_start = served.coords("prefill-a")
    assert client.lookup(any_start).result(timeout=5).incarnation == first
    assert client.lookup(replace(any_start, incarnation=first)).result(timeout=5).incarnation == first
    assert served.handshakes == 1  # the cached answer is the start asked for
    served.info = msgspec.structs.replace(
        served.info, incarnation=second
    )  # restarted under the same engine id
    assert client.lookup(replace(any_start, incarnation=second)).result(timeout=5).incarnation == second
    assert served.handshakes == 2  # the cached start was not the one asked for
    with pytest.raises(PeerGone, match=f"incarnation {second} runs there.*held by incarnation {first}"):
        client.lookup(replace(any_start, incarnation=first)).result(timeout=5)


def test_invalidate_forces_a_new_handshake(served: Served, client: SideChannelClient) -> None:
    client.lookup(served.coords("prefill-a")).result(timeout=5)
    client.invalidate(served.coords("prefill-a"))
    client.lookup(served.coords("prefill-a")).result(timeout=5)
    assert served.handshakes == 2


def test_failed_lookups_are_not_cached(served: Served, client: SideChannelClient) -> None:
    served.info = None
    with pytest.raises(SideChannelError, match="refused the handshake: engine still starting"):
        client.lookup(served.coords("prefill-a")).result(timeout=5)
    served.info = engine_info("prefill-a")
    assert client.lookup(served.coords("prefill-a")).result(timeout=5) == served.info


def test_tp_size_other_than_the_request_says_is_refused(served: Served, client: SideChannelClient) -> None:
    with pytest.raises(SideChannelError, match="has TP size 2, the request says 4"):
        client.lookup(served.coords("prefill-a", tp=4)).result(timeout=5)


def test_unreachable_side_channel_fails_fast() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    with pytest.raises(SideChannelError, match="unreachable"):
        fetch_engine_info("127.0.0.1", port, timeout_s=1)


def test_a_silent_server_fails_the_handshake_at_the_timeout() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:
        start = time.monotonic()
        with pytest.raises(SideChannelError, match=r"unreachable|timed out"):
            fetch_engine_info("127.0.0.1", silent.getsockname()[1], timeout_s=0.5)
        assert time.monotonic() - start < 2.0


def _raw_exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_server_drops_an_oversized_request_without_reading_it(served: Served) -> None:
    assert _raw_exchange(served.server.port, struct.pack(">4sI", MAGIC, MAX_FRAME_BYTES + 1)) == b""
    assert served.handshakes == 0


def test_server_answers_malformed_and_other_version_requests_with_an_error(served: Served) -> None:
    garbage = b"\xc1\xc1"
    reply = _raw_exchange(served.server.port, struct.pack(">4sI", MAGIC, len(garbage)) + garbage)
    assert b"malformed side-channel request" in reply
    other = msgspec.msgpack.encode({"version": 99})
    reply = _raw_exchange(served.server.port, struct.pack(">4sI", MAGIC, len(other)) + other)
    assert b"side-channel version 99 is not supported" in reply


def test_client_refuses_an_oversized_reply() -> None:
    with socket.create_server(("127.0.0.1", 0)) as liar:

        def answer() -> None:
            conn, _ = liar.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(struct.pack(">4sI", MAGIC, MAX_FRAME_BYTES + 1))

        thread = threading.Thread(target=answer)
        thread.start()
        with pytest.raises(SideChannelError, match="exceeds"):
            fetch_engine_info("127.0.0.1", liar.getsockname()[1], timeout_s=2)
        thread.join(5)


def test_a_peer_trickling_its_request_is_dropped_at_the_frame_deadline_not_per_byte() -> None:
    served = Served(engine_info("prefill-a"))
    server = SideChannelServer("127.0.0.1", 0, engine_info=served.answer, io_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            start = time.monotonic()
            header = struct.pack(">4sI", MAGIC, 64)
            closed_after = None
            for byte in (header + bytes(64))[
                :40
            ]:  # one byte every 0.1 s: each recv alone would be well inside 0.5 s
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    closed_after = time.monotonic() - start
                    break
                time.sleep(0.1)
            sock.settimeout(2)
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1) == b""  # the server closed the connection without answering
            closed_after = closed_after or time.monotonic() - start
        assert served.handshakes == 0
        # the whole frame's deadline (0.5 s) ended it; per byte it would last 40 x 0.1 s + 0.5 s
        assert closed_after < 2.0
    finally:
        server.close()


def test_connections_beyond_the_limit_are_closed_at_once_and_the_server_serves_again_after(
    served: Served,
) -> None:
    server = SideChannelServer("127.0.0.1", 0, engine_info=served.answer, io_timeout_s=5.0, max_connections=2)
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=2) for _ in range(2)]
        time.sleep(0.2)  # both are being served (waiting for their request)
        start = time.monotonic()
        with pytest.raises(SideChannelError):
            fetch_engine_info("127.0.0.1", server.port, timeout_s=2)
        assert time.monotonic() - start < 1.0
        for sock in idle:
            sock.close()
        deadline = time.monotonic() + 5
        while True:
            try:
                assert fetch_engine_info("127.0.0.1", server.port, timeout_s=2).engine_id == "prefill-a"
                break
            except SideChannelError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    finally:
        server.close()
