"""The transport contract, run against every implementation (NixlTransport over real NIXL/UCX on
host memory, MockTransport over TCP), with both agents in this process and across processes."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
from pdconnector.transport import (
    EMPTY_DESCRIPTORS,
    MAX_NOTIFICATION_BYTES,
    MemoryRegion,
    TransferState,
    Transport,
    TransportError,
)

from tests.pdconnector.transport.conftest import Pair
from tests.pdconnector.transport.harness import Buffer, PeerProcess, descs_at, finish, pattern, wait_for


def _notifications(
    agent: Transport, count: int, *, pump: tuple[Transport, ...] = ()
) -> list[tuple[str, bytes]]:
    received: list[tuple[str, bytes]] = []
    wait_for(
        lambda: received.extend(agent.take_notifications()) or len(received) >= count,
        timeout=10,
        pump=pump,
        what=f"{count} notifications",
    )
    return received


def _scattered_spans(rng: np.random.Generator, count: int, size: int, space: int) -> list[tuple[int, int]]:
    slots = rng.permutation(space // size)[:count]
    return [(int(slot) * size, size) for slot in slots]


# -- in one process ------------------------------------------------------------------------------


def test_write_lands_the_bytes_notifies_once_and_leaves_the_rest_untouched(pair: Pair) -> None:
    spans = [(0, 100), (1000, 3000), (40000, 5)]
    dst_spans = [(50000, 100), (10, 3000), (65531, 5)]
    handle = pair.a.write(pair.peer_b, pair.src.descs(spans), pair.dst.descs(dst_spans), b"done:1")
    assert handle.nbytes == 3105 and handle.num_descriptors == 3
    assert finish(pair.a, handle, pump=(pair.b,)).state is TransferState.DONE

    expected = np.zeros_like(pair.dst.array)
    for (s, n), (d, _) in zip(spans, dst_spans, strict=True):
        expected[d : d + n] = pair.src.array[s : s + n]
    assert np.array_equal(pair.dst.array, expected)
    assert _notifications(pair.b, 1) == [(pair.peer_a, b"done:1")]
    wait_for(lambda: True, timeout=0.05, pump=(pair.a, pair.b))
    assert pair.b.take_notifications() == []
    pair.a.release(handle)


def test_read_fetches_the_bytes_and_notifies_the_peer(pair: Pair) -> None:
    pair.dst.array[:] = pattern(pair.dst.array.nbytes, seed=9)
    before = pair.src.array.copy()
    handle = pair.a.read(
        pair.peer_b,
        pair.src.descs([(0, 4096), (8192, 10)]),
        pair.dst.descs([(300, 4096), (0, 10)]),
        b"read:7",
    )
    assert finish(pair.a, handle, pump=(pair.b,)).state is TransferState.DONE

    expected = before.copy()
    expected[0:4096] = pair.dst.array[300:4396]
    expected[8192:8202] = pair.dst.array[0:10]
    assert np.array_equal(pair.src.array, expected)
    assert _notifications(pair.b, 1) == [(pair.peer_a, b"read:7")]


def test_plain_notifications_arrive_once_each_in_order(pair: Pair) -> None:
    messages = [f"registration-{i}".encode() for i in range(20)]
    for message in messages:
        pair.b.notify(pair.peer_a, message)
    assert _notifications(pair.a, len(messages), pump=(pair.b,)) == [(pair.peer_b, m) for m in messages]


def test_many_descriptors_post_as_one_transfer(pair: Pair) -> None:
    rng = np.random.default_rng(3)
    src_spans, dst_spans = _scattered_spans(rng, 1024, 32, 1 << 16), _scattered_spans(rng, 1024, 32, 1 << 16)
    handle = pair.a.write(pair.peer_b, pair.src.descs(src_spans), pair.dst.descs(dst_spans), b"many")
    assert handle.num_descriptors == 1024
    assert finish(pair.a, handle, pump=(pair.b,)).state is TransferState.DONE
    for (s, n), (d, _) in zip(src_spans, dst_spans, strict=True):
        assert np.array_equal(pair.dst.array[d : d + n], pair.src.array[s : s + n])
    assert _notifications(pair.b, 1) == [(pair.peer_a, b"many")]


def test_an_empty_transfer_only_delivers_its_notification(pair: Pair) -> None:
    handle = pair.a.write(pair.peer_b, EMPTY_DESCRIPTORS, EMPTY_DESCRIPTORS, b"nothing-to-move")
    assert handle.nbytes == 0
    assert finish(pair.a, handle, pump=(pair.b,)).state is TransferState.DONE
    zero_length = pair.a.write(
        pair.peer_b, pair.src.descs([(0, 0), (5, 3)]), pair.dst.descs([(9, 0), (20, 3)])
    )
    assert zero_length.num_descriptors == 1
    assert finish(pair.a, zero_length, pump=(pair.b,)).state is TransferState.DONE
    assert _notifications(pair.b, 1) == [(pair.peer_a, b"nothing-to-move")]
    assert pair.dst.array[9] == 0 and np.array_equal(pair.dst.array[20:23], pair.src.array[5:8])


@pytest.mark.parametrize(
    "bad_span",
    [(1 << 16, 1), ((1 << 16) - 10, 11), (-(1 << 20), 16)],
    ids=["past-end", "straddles-end", "before-start"],
)
def test_a_remote_descriptor_outside_the_peers_registered_memory_moves_nothing(
    pair: Pair, bad_span: tuple[int, int]
) -> None:
    offset, length = bad_span
    remote = np.concatenate([pair.dst.descs([(0, 64)]), descs_at(pair.dst.addr + offset, [(0, length)])])
    local = pair.src.descs([(0, 64), (100, length)])
    with pytest.raises(TransportError, match="outside"):
        pair.a.write(pair.peer_b, local, remote, b"must-not-arrive")
    wait_for(lambda: True, timeout=0.05, pump=(pair.a, pair.b))
    assert not pair.dst.array.any()
    assert pair.b.take_notifications() == []


def test_a_local_descriptor_outside_the_agents_registered_memory_is_refused(pair: Pair) -> None:
    unregistered = Buffer(128, seed=5)
    with pytest.raises(TransportError, match=r"local descriptor 1 .* outside"):
        pair.a.write(
            pair.peer_b,
            np.concatenate([pair.src.descs([(0, 8)]), unregistered.descs([(0, 8)])]),
            pair.dst.descs([(0, 8), (8, 8)]),
        )
    assert not pair.dst.array.any()


def test_an_unknown_peer_is_an_error(pair: Pair) -> None:
    descs = pair.src.descs([(0, 8)])
    for call in (
        lambda: pair.a.write("nobody", descs, descs),
        lambda: pair.a.read("nobody", descs, descs),
        lambda: pair.a.notify("nobody", b"x"),
        lambda: pair.a.remove_peer("nobody"),
    ):
        with pytest.raises(TransportError, match="unknown peer 'nobody'"):
            call()


def test_a_removed_peer_is_unknown_afterwards(pair: Pair) -> None:
    pair.a.remove_peer(pair.peer_b)
    with pytest.raises(TransportError, match="unknown peer"):
        pair.a.notify(pair.peer_b, b"x")
    assert pair.a.add_peer(pair.b.metadata()) == pair.peer_b
    pair.a.notify(pair.peer_b, b"back")
    assert _notifications(pair.b, 1, pump=(pair.a,)) == [(pair.peer_a, b"back")]


@pytest.mark.parametrize(
    ("local", "remote", "message"),
    [
        (np.zeros((2, 2), dtype=np.int64), np.zeros((2, 2), dtype=np.int64), r"shape \(N, 3\)"),
        (np.zeros((2, 3)), np.zeros((2, 3)), "integers"),
        (
            np.zeros((2, 3), dtype=np.int64),
            np.zeros((1, 3), dtype=np.int64),
            "local has 2 descriptors but remote has 1",
        ),
        (np.array([[1, 8, 0]]), np.array([[1, 9, 0]]), "local length 8 != remote length 9"),
        (np.array([[1, -8, 0]]), np.array([[1, -8, 0]]), "negative"),
    ],
    ids=["shape", "dtype", "count", "lengths", "negative"],
)
def test_malformed_descriptors_are_refused_with_the_reason(
    pair: Pair, local: np.ndarray, remote: np.ndarray, message: str
) -> None:
    with pytest.raises(TransportError, match=message):
        pair.a.write(pair.peer_b, local, remote)


def test_an_oversized_notification_is_refused(pair: Pair) -> None:
    with pytest.raises(TransportError, match="exceeds"):
        pair.a.notify(pair.peer_b, b"x" * (MAX_NOTIFICATION_BYTES + 1))


def test_calls_from_a_thread_that_does_not_own_the_agent_are_refused(pair: Pair) -> None:
    errors: list[BaseException] = []

    def intruder() -> None:
        try:
            pair.a.notify(pair.peer_b, b"from-elsewhere")
        except TransportError as error:
            errors.append(error)

    thread = threading.Thread(target=intruder)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "confined to thread" in str(errors[0])


def test_an_agent_handed_to_another_thread_works_there_and_only_there(pair: Pair) -> None:
    outcome: list[object] = []

    def worker() -> None:
        pair.a.bind_to_current_thread()
        handle = pair.a.write(
            pair.peer_b, pair.src.descs([(0, 64)]), pair.dst.descs([(0, 64)]), b"from-worker"
        )
        outcome.append(finish(pair.a, handle, timeout=10).state)

    thread = threading.Thread(target=worker)
    # The receiver keeps making progress on this thread while the worker transfers.
    thread.start()
    wait_for(lambda: not thread.is_alive(), timeout=15, pump=(pair.b,), what="worker done")
    assert outcome == [TransferState.DONE]
    with pytest.raises(TransportError, match="confined"):
        pair.a.notify(pair.peer_b, b"x")
    pair.a.bind_to_current_thread()
    assert np.array_equal(pair.dst.array[:64], pair.src.array[:64])


def test_handles_are_final_once_released_and_an_unknown_handle_is_an_error(pair: Pair) -> None:
    handle = pair.a.write(pair.peer_b, pair.src.descs([(0, 8)]), pair.dst.descs([(0, 8)]))
    finish(pair.a, handle, pump=(pair.b,))
    pair.a.release(handle)
    with pytest.raises(TransportError, match="unknown or released transfer handle"):
        pair.a.state(handle)
    with pytest.raises(TransportError, match="unknown or released transfer handle"):
        pair.a.release(handle)


def test_a_closed_agent_refuses_every_call(make_agent: Callable[[str], Transport]) -> None:
    agent = make_agent("closing")
    agent.close()
    agent.close()
    with pytest.raises(TransportError, match="after close"):
        agent.metadata()


def test_overlapping_or_mixed_registrations_are_refused(make_agent: Callable[[str], Transport]) -> None:
    agent = make_agent("regions")
    buffer = Buffer(4096)
    agent.register([buffer.region])
    with pytest.raises(TransportError, match="overlaps"):
        agent.register([MemoryRegion(buffer.addr + 100, 10)])


def test_metadata_of_the_other_transport_is_refused_clearly(
    make_agent: Callable[[str], Transport], kind: str
) -> None:
    agent = make_agent("meta")
    with pytest.raises(TransportError, match="metadata"):
        agent.add_peer(b'{"kind": "something-else"}' if kind == "nixl" else b"pdconnector-nixl/1\n{}\n")
    with pytest.raises(TransportError, match="metadata"):
        agent.add_peer(b"\x00garbage")


# -- across processes -----------------------------------------------------------------------------


@pytest.fixture
def child(
    spawn_peer: Callable[[int, int], PeerProcess], make_agent: Callable[[str], Transport]
) -> tuple[PeerProcess, Transport, Buffer, str]:
    """A peer process owning 64 KiB of pattern(seed=2), and a local agent owning 64 KiB of pattern(seed=1);
    connected both ways."""
    peer = spawn_peer(1 << 16, 2)
    local = make_agent("parent")
    buffer = Buffer(1 << 16, seed=1)
    local.register([buffer.region])
    name = local.add_peer(peer.metadata)
    assert peer.add_peer(local.metadata()) == local.name
    peer.pump = local
    return peer, local, buffer, name


def test_write_across_processes_lands_bytes_and_one_notification(
    child: tuple[PeerProcess, Transport, Buffer, str],
) -> None:
    peer, local, buffer, name = child
    rng = np.random.default_rng(11)
    src_spans, dst_spans = _scattered_spans(rng, 64, 256, 1 << 16), _scattered_spans(rng, 64, 256, 1 << 16)
    handle = local.write(name, buffer.descs(src_spans), descs_at(peer.addr, dst_spans), b"xproc-write")
    assert finish(local, handle).state is TransferState.DONE

    expected = pattern(1 << 16, 2)
    for (s, n), (d, _) in zip(src_spans, dst_spans, strict=True):
        expected[d : d + n] = buffer.array[s : s + n]
    assert np.array_equal(peer.dump(), expected)
    assert peer.notifications(1) == [(local.name, b"xproc-write")]
    assert peer.notifications(0, timeout=0.2) == []


def test_read_across_processes_fetches_bytes_and_notifies_the_owner(
    child: tuple[PeerProcess, Transport, Buffer, str],
) -> None:
    peer, local, buffer, name = child
    handle = local.read(
        name, buffer.descs([(0, 1 << 15)]), descs_at(peer.addr, [(1 << 15, 1 << 15)]), b"xproc-read"
    )
    assert finish(local, handle).state is TransferState.DONE
    assert np.array_equal(buffer.array[: 1 << 15], pattern(1 << 16, 2)[1 << 15 :])
    assert np.array_equal(buffer.array[1 << 15 :], pattern(1 << 16, 1)[1 << 15 :])
    assert peer.notifications(1) == [(local.name, b"xproc-read")]


def test_a_peer_process_writes_into_this_one_and_notifies(
    child: tuple[PeerProcess, Transport, Buffer, str],
) -> None:
    peer, local, buffer, name = child
    peer.post("write", local.name, [(0, 512)], buffer.descs([(4096, 512)]), b"from-child")
    assert _notifications(local, 1) == [(peer.name, b"from-child")]
    assert peer.reply()["state"] == "DONE"
    assert np.array_equal(buffer.array[4096:4608], pattern(1 << 16, 2)[:512])
    local.notify(name, b"ping")
    assert peer.notifications(1) == [(local.name, b"ping")]


def test_a_killed_peer_process_fails_the_next_transfer_within_a_deadline(
    child: tuple[PeerProcess, Transport, Buffer, str],
) -> None:
    peer, local, buffer, name = child
    first = local.write(name, buffer.descs([(0, 1024)]), descs_at(peer.addr, [(0, 1024)]), b"before")
    assert finish(local, first).state is TransferState.DONE
    peer.kill()

    try:
        handle = local.write(name, buffer.descs([(0, 1024)]), descs_at(peer.addr, [(0, 1024)]), b"after")
    except TransportError:
        pass
    else:
        status = finish(local, handle, timeout=10)
        assert status.state is TransferState.FAILED, status
        assert status.error
        local.release(handle)
    with pytest.raises(TransportError):
        local.notify(name, b"anyone-there")


def test_an_idle_connected_agent_does_not_burn_cpu(child: tuple[PeerProcess, Transport, Buffer, str]) -> None:
    # Guards against NIXL's UCX progress thread, which polls with a zero timeout (about one core per agent).
    peer, local, buffer, name = child
    handle = local.write(name, buffer.descs([(0, 1024)]), descs_at(peer.addr, [(0, 1024)]), b"warm-up")
    assert finish(local, handle).state is TransferState.DONE
    assert peer.idle_cpu_seconds(2.0) < 0.5
