"""MockTransport's receiving side against a hostile or broken sender (raw frames on a socket):
it never writes outside its registered regions, never allocates what a header merely claims, and
keeps serving everyone else."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest
from pdconnector.transport import Device, MemoryRegion, MockTransport, TransferState, TransportError
from pdconnector.transport import mock_wire as wire
from pdconnector.transport.mock_faults import MockFaults

from tests.pdconnector.transport.harness import Buffer, descs_at, finish, wait_for


@pytest.fixture
def target() -> Iterator[tuple[MockTransport, Buffer]]:
    agent = MockTransport("target")
    buffer = Buffer(4096)
    agent.register([buffer.region])
    yield agent, buffer
    agent.close()


def _connect(agent: MockTransport, name: str = "raw-sender") -> socket.socket:
    sock = socket.create_connection(agent.address, timeout=5)
    wire.send_frame(sock, wire.FrameKind.HELLO, name.encode())
    return sock


def _ack(sock: socket.socket) -> tuple[int, str, int]:
    kind, meta, stream_len = wire.recv_frame(sock)
    assert kind is wire.FrameKind.ACK
    transfer_id, error = wire.decode_ack(meta)
    return transfer_id, error, stream_len


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_write_aimed_outside_the_registered_region_is_rejected_and_nothing_lands(
    target: tuple[MockTransport, Buffer],
) -> None:
    agent, buffer = target
    sock = _connect(agent)
    destination = descs_at(buffer.addr, [(0, 16), (4090, 16)])
    wire.send_frame(sock, wire.FrameKind.WRITE, wire.encode_transfer(7, b"forged", destination), 32)
    sock.sendall(b"\xff" * 32)
    transfer_id, error, _ = _ack(sock)
    assert transfer_id == 7 and "remote descriptor 1" in error and "outside" in error
    assert not buffer.array.any()

    # The connection stays usable for a valid transfer.
    wire.send_frame(
        sock, wire.FrameKind.WRITE, wire.encode_transfer(8, b"valid", descs_at(buffer.addr, [(100, 4)])), 4
    )
    sock.sendall(b"\x01\x02\x03\x04")
    assert _ack(sock) == (8, "", 0)
    assert buffer.array[100:104].tolist() == [1, 2, 3, 4] and buffer.array.sum() == 10
    assert wait_for(agent.take_notifications, timeout=5) == [("raw-sender", b"valid")]
    sock.close()


def test_a_write_whose_stream_disagrees_with_its_descriptors_is_rejected(
    target: tuple[MockTransport, Buffer],
) -> None:
    agent, buffer = target
    sock = _connect(agent)
    wire.send_frame(
        sock, wire.FrameKind.WRITE, wire.encode_transfer(1, b"", descs_at(buffer.addr, [(0, 8)])), 16
    )
    sock.sendall(b"\xff" * 16)
    transfer_id, error, _ = _ack(sock)
    assert transfer_id == 1 and "does not match" in error
    assert not buffer.array.any()
    sock.close()


def test_a_write_claiming_more_bytes_than_were_registered_drops_the_connection(
    target: tuple[MockTransport, Buffer],
) -> None:
    agent, buffer = target
    sock = _connect(agent)
    wire.send_frame(
        sock,
        wire.FrameKind.WRITE,
        wire.encode_transfer(1, b"", descs_at(buffer.addr + 10**9, [(0, 1 << 40)])),
        1 << 40,
    )
    assert _closed_by_peer(sock)
    sock.close()


def test_a_read_outside_the_registered_region_returns_no_bytes(target: tuple[MockTransport, Buffer]) -> None:
    agent, buffer = target
    sock = _connect(agent)
    wire.send_frame(
        sock, wire.FrameKind.READ, wire.encode_transfer(3, b"peek", descs_at(buffer.addr - 64, [(0, 128)]))
    )
    transfer_id, error, stream_len = _ack(sock)
    assert transfer_id == 3 and "outside" in error and stream_len == 0
    assert agent.take_notifications() == []
    sock.close()


@pytest.mark.parametrize(
    "garbage",
    [
        b"NOPE" + bytes(13),
        wire.MAGIC + bytes([99]) + bytes(12),
        wire.MAGIC + bytes([wire.FrameKind.WRITE]) + (wire.MAX_META_BYTES + 1).to_bytes(4, "big") + bytes(8),
    ],
    ids=["bad-magic", "unknown-kind", "oversized-metadata"],
)
def test_a_malformed_frame_closes_only_that_connection(
    target: tuple[MockTransport, Buffer], garbage: bytes
) -> None:
    agent, buffer = target
    bad = _connect(agent, "bad")
    bad.sendall(garbage)
    assert _closed_by_peer(bad)
    bad.close()

    good = _connect(agent, "good")
    wire.send_frame(good, wire.FrameKind.NOTIFY, b"still-serving")
    assert wait_for(agent.take_notifications, timeout=5) == [("good", b"still-serving")]
    good.close()
    assert not buffer.array.any()


def test_a_sender_dying_mid_stream_delivers_no_notification(target: tuple[MockTransport, Buffer]) -> None:
    agent, _ = target
    sock = _connect(agent)
    wire.send_frame(
        sock,
        wire.FrameKind.WRITE,
        wire.encode_transfer(1, b"never", descs_at(target[1].addr, [(0, 1024)])),
        1024,
    )
    sock.sendall(b"\x01" * 100)
    sock.close()
    sock = _connect(agent)
    wire.send_frame(sock, wire.FrameKind.NOTIFY, b"after")
    assert wait_for(agent.take_notifications, timeout=5) == [("raw-sender", b"after")]
    sock.close()


def test_adding_a_peer_that_is_gone_fails_promptly(target: tuple[MockTransport, Buffer]) -> None:
    agent, _ = target
    with MockTransport("doomed") as doomed:
        buffer = Buffer(64)
        doomed.register([buffer.region])
        metadata = doomed.metadata()
    with pytest.raises(TransportError, match="cannot connect to peer 'doomed'"):
        agent.add_peer(metadata)


def test_a_stalled_peer_blocks_neither_the_poster_nor_transfers_to_other_peers(
    target: tuple[MockTransport, Buffer],
) -> None:
    """Like NIXL, a post only queues the transfer: a peer that stops reading (frozen, CPU-starved) holds its
    own link only."""
    healthy, healthy_buffer = target
    # far beyond the loopback socket buffers, so this WRITE cannot finish while nobody reads
    nbytes = 64 << 20
    with socket.create_server(("127.0.0.1", 0)) as listener, MockTransport("sender") as sender:
        source = Buffer(nbytes, seed=3)
        sender.register([source.region])
        fake_region = MemoryRegion(1 << 40, nbytes)
        stalled = sender.add_peer(
            wire.encode_metadata("stalled", "127.0.0.1", listener.getsockname()[1], [fake_region])
        )
        connection, _ = listener.accept()  # accepted, never read
        with connection:
            started = time.monotonic()
            stuck = sender.write(
                stalled, source.descs([(0, nbytes)]), descs_at(fake_region.addr, [(0, nbytes)]), b"stuck"
            )
            assert time.monotonic() - started < 0.5, "posting must not wait for the peer to read"
            peer = sender.add_peer(healthy.metadata())
            other = sender.write(peer, source.descs([(0, 4096)]), healthy_buffer.descs([(0, 4096)]), b"other")
            assert finish(sender, other, timeout=5).state is TransferState.DONE
            assert np.array_equal(healthy_buffer.array, source.array[:4096])
            assert sender.state(stuck).state is TransferState.IN_PROGRESS
        # The stalled peer goes away: its WRITE fails instead of hanging.
        status = finish(sender, stuck, timeout=5)
        assert status.state is TransferState.FAILED and "stalled" in status.error


def test_host_memory_only() -> None:
    with MockTransport("vram") as agent, pytest.raises(TransportError, match="host memory"):
        agent.register([MemoryRegion(4096, 4096, Device.VRAM)])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"kind": "pdconnector-mock-transport", "version": 2}', "version 2"),
        (
            b'{"kind": "pdconnector-mock-transport", "version": 1, "name": "", "host": "h", "port": 1, '
            b'"regions": []}',
            "'name'",
        ),
        (
            b'{"kind": "pdconnector-mock-transport", "version": 1, "name": "n", "host": "h", "port": 0, '
            b'"regions": []}',
            "'port'",
        ),
        (
            b'{"kind": "pdconnector-mock-transport", "version": 1, "name": "n", "host": "h", "port": 1, '
            b'"regions": [[1, 2]]}',
            "'regions'",
        ),
        (
            b'{"kind": "pdconnector-mock-transport", "version": 1, "name": "n", "host": "h", "port": 1, '
            b'"regions": [[1, 0, 0]]}',
            "nbytes",
        ),
        (b"x" * (wire.MAX_METADATA_BYTES + 1), "exceeds"),
    ],
    ids=["version", "name", "port", "region-shape", "region-size", "oversized"],
)
def test_bad_peer_metadata_names_the_field(body: bytes, message: str) -> None:
    with pytest.raises(TransportError, match=message):
        wire.decode_metadata(body)


def test_metadata_round_trips() -> None:
    regions = (MemoryRegion(4096, 100), MemoryRegion(1 << 40, 1 << 30, Device.DRAM, 0))
    info = wire.decode_metadata(wire.encode_metadata("agent", "10.0.0.7", 5600, regions))
    assert (info.name, info.host, info.port, info.regions) == ("agent", "10.0.0.7", 5600, regions)


def test_frames_round_trip_descriptors_and_notification() -> None:
    descriptors = np.array([[1 << 45, 7, 0], [12, 0, 3]], dtype=np.int64)
    transfer_id, notification, decoded = wire.decode_transfer(
        wire.encode_transfer(1 << 60, b"n" * 1000, descriptors)
    )
    assert transfer_id == 1 << 60 and notification == b"n" * 1000 and np.array_equal(decoded, descriptors)
    with pytest.raises(wire.WireError, match="inconsistent"):
        wire.decode_transfer(wire.encode_transfer(1, b"abc", descriptors)[:-5])


def test_a_transfer_in_flight_cannot_be_released_and_is_released_once_final(
    target: tuple[MockTransport, Buffer],
) -> None:
    """Nothing takes a posted WRITE back: the fence counts on release() refusing until the bytes have
    landed."""
    agent, buffer = target
    sender = MockTransport("late-sender", faults=MockFaults(write_delay_s=1.0))
    source = Buffer(4096)
    sender.register([source.region])
    try:
        peer = sender.add_peer(agent.metadata())
        handle = sender.write(peer, source.descs([(0, 512)]), descs_at(buffer.addr, [(0, 512)]), b"late")
        with pytest.raises(TransportError, match="in flight and cannot be cancelled"):
            sender.release(handle)
        assert finish(sender, handle, timeout=10).state is TransferState.DONE
        sender.release(handle)
    finally:
        sender.close()
