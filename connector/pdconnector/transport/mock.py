"""MockTransport: the transport contract over TCP between processes (pods), bytes really copied.

Each agent listens on ``host:port``; its metadata is that address plus its registered regions.
A WRITE streams the source bytes with the destination descriptors; the receiver checks every
destination lies inside its own registered regions (rejecting the whole transfer otherwise, so
nothing is written outside a region), copies the bytes into place, queues the notification and
acks. A READ is the same in reverse. The initiator's reader thread turns acks into transfer states.

Threads: public methods run on the owner thread (see :mod:`pdconnector.transport.base`) and never
block on a peer: like NIXL's, a post only queues the transfer. Each outbound connection has a
sender thread, the only one that writes to it (frames in posting order, WRITE data read from
registered memory), and a reader thread that turns acks into transfer states. The listener and one
thread per inbound connection apply peers' transfers. Background threads touch the inbox and the
transfer table under ``self._lock`` and exit when their socket is closed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pdconnector.transport import mock_wire as wire
from pdconnector.transport.base import (
    MAX_NOTIFICATION_BYTES,
    Device,
    MemoryRegion,
    Operation,
    PeerUnreachable,
    TransferHandle,
    TransferState,
    TransferStatus,
    TransferTable,
    Transport,
    TransportError,
    check_notification,
    confined,
)
from pdconnector.transport.descriptors import RegionTable, pair_descriptors
from pdconnector.transport.mock_faults import MockFaults

log = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 2.0
IN_PROGRESS = TransferStatus(TransferState.IN_PROGRESS)


def _low_latency(sock: socket.socket, io_timeout_s: float) -> None:
    """Frames are small request/acknowledge pairs: without TCP_NODELAY, Nagle and delayed ACKs add ~40 ms to
    each."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(io_timeout_s)


@dataclass
class _Transfer:
    handle: TransferHandle
    local: np.ndarray
    status: TransferStatus = field(default_factory=lambda: IN_PROGRESS)


@dataclass(frozen=True)
class _Outgoing:
    """A frame for the sender thread; a WRITE's source bytes (``local`` descriptors) follow its frame."""

    kind: wire.FrameKind
    meta: bytes
    local: np.ndarray | None = None
    nbytes: int = 0


@dataclass
class _Link:
    """The outbound connection to one peer."""

    info: wire.PeerInfo
    regions: RegionTable
    sock: socket.socket
    reader: threading.Thread | None = None
    sender: threading.Thread | None = None
    # None stops the sender
    outbox: queue.SimpleQueue[_Outgoing | None] = field(default_factory=queue.SimpleQueue)
    error: str = ""
    transfers: set[int] = field(default_factory=set)


class MockTransport(Transport):
    """Args:
    name: agent name (engine id + rank), unique among the agents that talk to each other.
    host: interface the listener binds to (``0.0.0.0`` in a pod).
    port: listener port; 0 picks a free one.
    advertise_host: address peers connect to (the pod IP), defaults to ``host``.
    io_timeout_s: bound on every blocking socket send/receive of a frame; a peer that stalls
        longer is treated as disconnected.
    faults: late WRITEs and lost or late notifications to inject (chaos tests, :mod:`.mock_faults`).
    notification_limit: the largest notification it carries, to stand in for a backend with a small one
    (LIBFABRIC).
    """

    def __init__(
        self,
        name: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        io_timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        faults: MockFaults | None = None,
        notification_limit: int = MAX_NOTIFICATION_BYTES,
    ) -> None:
        super().__init__(name, notification_limit=notification_limit)
        self._faults = faults
        self._dropper = faults.dropper() if faults is not None else None
        self._writes_delayed = 0
        self._io_timeout_s = io_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._regions = RegionTable()
        self._inbox: list[tuple[str, bytes]] = []
        self._transfers: TransferTable[_Transfer] = TransferTable(f"{name!r}")
        self._links: dict[str, _Link] = {}
        self._inbound: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._ids = itertools.count(1)
        try:
            self._listener = socket.create_server((host, port))
        except OSError as error:
            raise TransportError(f"MockTransport {name!r}: cannot listen on {host}:{port}: {error}") from None
        self._address = (advertise_host or host, self._listener.getsockname()[1])
        self._spawn(self._accept_loop, "listener")

    @property
    def address(self) -> tuple[str, int]:
        return self._address

    # -- owner-thread API ------------------------------------------------------------------

    @confined
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        if any(r.device is not Device.DRAM for r in regions):
            raise TransportError("MockTransport can only register host memory (device DRAM)")
        table = RegionTable([*self._regions.regions, *regions])
        with self._lock:
            self._regions = table

    @confined
    def metadata(self) -> bytes:
        return wire.encode_metadata(self.name, *self._address, self._regions.regions)

    @confined
    def add_peer(self, metadata: bytes) -> str:
        info = wire.decode_metadata(metadata)
        if info.name in self._links:
            self._drop_link(info.name, "peer metadata replaced")
        try:
            sock = socket.create_connection((info.host, info.port), timeout=self._connect_timeout_s)
            _low_latency(sock, self._io_timeout_s)
            wire.send_frame(sock, wire.FrameKind.HELLO, self.name.encode())
        except OSError as error:
            raise PeerUnreachable(
                f"{self.name!r}: cannot connect to peer {info.name!r} at {info.host}:{info.port}: {error}"
            ) from None
        link = _Link(info, RegionTable(info.regions), sock)
        link.reader = self._spawn(lambda: self._read_replies(link), f"reader-{info.name}")
        link.sender = self._spawn(lambda: self._send_queued(link), f"sender-{info.name}")
        self._links[info.name] = link
        return info.name

    @confined
    def remove_peer(self, peer: str) -> None:
        self._link(peer)
        self._drop_link(peer, "peer removed")

    @confined
    def write(
        self, peer: str, local: np.ndarray, remote: np.ndarray, notification: bytes = b""
    ) -> TransferHandle:
        return self._post(Operation.WRITE, peer, local, remote, notification)

    @confined
    def read(
        self, peer: str, local: np.ndarray, remote: np.ndarray, notification: bytes = b""
    ) -> TransferHandle:
        return self._post(Operation.READ, peer, local, remote, notification)

    @confined
    def state(self, handle: TransferHandle) -> TransferStatus:
        with self._lock:
            return self._transfers.of(handle).status

    @confined
    def release(self, handle: TransferHandle) -> None:
        with self._lock:
            transfer = self._transfers.of(handle)
            if not transfer.status.finished:
                # Its frame may be queued, on the wire or landing: nothing here can take it back (as with
                # RDMA).
                raise TransportError(
                    f"transfer {handle.id} to {handle.peer!r} is in flight and cannot be cancelled; release "
                    "it once final"
                )
            del self._transfers[handle.id]

    @confined
    def notify(self, peer: str, message: bytes) -> None:
        message = check_notification(message, self.notification_limit)
        link = self._link(peer)
        if link.error:
            raise TransportError(f"{self.name!r}: peer {peer!r} is disconnected: {link.error}")
        link.outbox.put(_Outgoing(wire.FrameKind.NOTIFY, message))

    @confined
    def progress(self) -> None:
        """Nothing to drive: background threads move the bytes."""

    @confined
    def take_notifications(self) -> list[tuple[str, bytes]]:
        with self._lock:
            taken, self._inbox = self._inbox, []
        return taken

    def close(self) -> None:
        if self._closed:
            return
        self._check_usable("close")
        self._closed = True
        for peer in list(self._links):
            self._drop_link(peer, "agent closed")
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            inbound = list(self._inbound)
        for sock in inbound:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(_JOIN_TIMEOUT_S)

    # -- owner-thread helpers -----------------------------------------------------------------

    def _link(self, peer: str) -> _Link:
        link = self._links.get(peer)
        if link is None:
            raise TransportError(
                f"{self.name!r}: unknown peer {peer!r}; add it with add_peer(metadata) first"
            )
        return link

    def _post(
        self, operation: Operation, peer: str, local: np.ndarray, remote: np.ndarray, notification: bytes
    ) -> TransferHandle:
        link = self._link(peer)
        local, remote = pair_descriptors(local, remote)
        notification = check_notification(notification, self.notification_limit)
        if local.shape[0] > wire.MAX_DESCRIPTORS:
            raise TransportError(
                f"{local.shape[0]} descriptors exceed MockTransport's limit of {wire.MAX_DESCRIPTORS} per "
                "transfer"
            )
        self._regions.check(local, "local", self.name)
        link.regions.check(remote, "remote", peer)
        nbytes = int(local[:, 1].sum())
        handle = TransferHandle(next(self._ids), peer, operation, int(local.shape[0]), nbytes)
        transfer = _Transfer(handle, local)
        with self._lock:
            self._transfers[handle.id] = transfer
            if link.error:
                transfer.status = TransferStatus(
                    TransferState.FAILED, f"peer {peer!r} is disconnected: {link.error}"
                )
                return handle
            link.transfers.add(handle.id)
        meta = wire.encode_transfer(handle.id, notification, remote)
        if operation is Operation.WRITE:
            link.outbox.put(_Outgoing(wire.FrameKind.WRITE, meta, local, nbytes))
        else:
            link.outbox.put(_Outgoing(wire.FrameKind.READ, meta))
        return handle

    def _drop_link(self, peer: str, reason: str) -> None:
        link = self._links.pop(peer)
        self._fail_link(link, reason)
        link.outbox.put(None)
        with contextlib.suppress(OSError):
            link.sock.shutdown(socket.SHUT_RDWR)  # also ends a send blocked on a stalled peer
        for thread in (link.reader, link.sender):
            if thread is not None:
                thread.join(_JOIN_TIMEOUT_S)
        link.sock.close()

    # -- any thread ---------------------------------------------------------------------------

    def _spawn(self, target: Callable[[], None], role: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=f"mock-transport-{self.name}-{role}", daemon=True)
        thread.start()
        with self._lock:
            # Connections come and go over an agent's life; keep only threads that may still need joining.
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        return thread

    def _fail_link(self, link: _Link, reason: str) -> None:
        """Mark the connection dead and fail everything still waiting on it."""
        with self._lock:
            link.error = link.error or reason
            for transfer_id in link.transfers:
                transfer = self._transfers.get(transfer_id)
                if transfer is not None and not transfer.status.finished:
                    transfer.status = TransferStatus(
                        TransferState.FAILED, f"peer {link.info.name!r} is disconnected: {link.error}"
                    )
            link.transfers.clear()

    # -- background threads -------------------------------------------------------------------

    def _send_queued(self, link: _Link) -> None:
        """Outbound connection: send the queued frames in order; a failed send fails the link and everything
        on it."""
        while (outgoing := link.outbox.get()) is not None:
            if link.error:
                continue  # its transfer was failed with the link
            if self._faults is not None and not self._inject(outgoing.kind):
                continue
            try:
                wire.send_frame(link.sock, outgoing.kind, outgoing.meta, outgoing.nbytes)
                if outgoing.local is not None:
                    wire.send_memory(link.sock, outgoing.local)
            except OSError as error:
                self._fail_link(link, f"send failed: {error}")

    def _inject(self, kind: wire.FrameKind) -> bool:
        """Apply the configured faults to one frame about to leave; False: drop it."""
        assert self._faults is not None and self._dropper is not None
        if kind is wire.FrameKind.WRITE:
            with self._lock:  # one sender thread per link: count the delayed WRITEs across them
                delay = self._faults.delayed_writes < 0 or self._writes_delayed < self._faults.delayed_writes
                self._writes_delayed += delay
            if delay:
                time.sleep(self._faults.write_delay_s)
        elif kind is wire.FrameKind.NOTIFY:
            if self._dropper.random() < self._faults.notification_drop_rate:
                log.warning("%s: notification dropped (injected fault)", self.name)
                return False
            time.sleep(self._faults.notification_delay_s)
        return True

    def _read_replies(self, link: _Link) -> None:
        """Outbound connection: turn acks into transfer states and land READ data."""
        try:
            while True:
                kind, meta, stream_len = wire.recv_frame(link.sock)
                if kind is not wire.FrameKind.ACK:
                    raise wire.WireError(f"unexpected {kind.name} frame on an outbound connection")
                transfer_id, error = wire.decode_ack(meta)
                self._complete(link, transfer_id, error, stream_len)
        except (OSError, wire.WireError) as error:
            self._fail_link(link, str(error) or type(error).__name__)

    def _complete(self, link: _Link, transfer_id: int, error: str, stream_len: int) -> None:
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            landing = transfer is not None and not error and stream_len > 0
            if landing and stream_len != transfer.handle.nbytes:
                raise wire.WireError(
                    f"READ {transfer_id}: peer returned {stream_len} bytes, expected {transfer.handle.nbytes}"
                )
        if landing:  # still in flight while its bytes land, so release() refuses to drop it meanwhile
            wire.recv_memory(link.sock, transfer.local)
        elif stream_len:
            wire.discard(link.sock, stream_len)
        with self._lock:
            link.transfers.discard(transfer_id)
            if transfer is not None and not transfer.status.finished:
                transfer.status = (
                    TransferStatus(TransferState.FAILED, error)
                    if error
                    else TransferStatus(TransferState.DONE)
                )

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            _low_latency(sock, self._io_timeout_s)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._inbound.add(sock)
            self._spawn(lambda sock=sock: self._serve(sock), "inbound")

    def _serve(self, sock: socket.socket) -> None:
        """Inbound connection: apply a peer's WRITEs, answer its READs, queue its notifications."""
        try:
            kind, meta, _ = wire.recv_frame(sock)
            if kind is not wire.FrameKind.HELLO:
                raise wire.WireError(f"expected HELLO, got {kind.name}")
            peer = meta.decode(errors="replace")
            while True:
                kind, meta, stream_len = wire.recv_frame(sock)
                if kind is wire.FrameKind.NOTIFY:
                    self._deliver(peer, meta)
                elif kind is wire.FrameKind.WRITE:
                    self._apply_write(sock, peer, meta, stream_len)
                elif kind is wire.FrameKind.READ:
                    self._answer_read(sock, peer, meta)
                else:
                    raise wire.WireError(f"unexpected {kind.name} frame on an inbound connection")
        except (OSError, wire.WireError):
            pass
        finally:
            with self._lock:
                self._inbound.discard(sock)
            sock.close()

    def _deliver(self, peer: str, notification: bytes) -> None:
        if notification:
            with self._lock:
                self._inbox.append((peer, notification))

    def _check_destination(self, descriptors: np.ndarray, stream_len: int | None) -> str:
        with self._lock:
            regions = self._regions
        try:
            regions.check(descriptors, "remote", self.name)
        except TransportError as error:
            return str(error)
        if stream_len is not None and stream_len != int(descriptors[:, 1].sum()):
            return (
                f"stream of {stream_len} bytes does not match the descriptors' "
                f"{int(descriptors[:, 1].sum())} bytes"
            )
        return ""

    def _apply_write(self, sock: socket.socket, peer: str, meta: bytes, stream_len: int) -> None:
        transfer_id, notification, descriptors = wire.decode_transfer(meta)
        error = self._check_destination(descriptors, stream_len)
        if error:
            with self._lock:
                registered = sum(r.nbytes for r in self._regions.regions)
            if stream_len > registered:
                raise wire.WireError(
                    f"WRITE {transfer_id} from {peer!r} carries {stream_len} bytes, more than this agent "
                    "registered"
                )
            wire.discard(sock, stream_len)
        else:
            wire.recv_memory(sock, descriptors)
            self._deliver(peer, notification)
        wire.send_frame(sock, wire.FrameKind.ACK, wire.encode_ack(transfer_id, error))

    def _answer_read(self, sock: socket.socket, peer: str, meta: bytes) -> None:
        transfer_id, notification, descriptors = wire.decode_transfer(meta)
        error = self._check_destination(descriptors, None)
        if error:
            wire.send_frame(sock, wire.FrameKind.ACK, wire.encode_ack(transfer_id, error))
            return
        wire.send_frame(
            sock, wire.FrameKind.ACK, wire.encode_ack(transfer_id, ""), int(descriptors[:, 1].sum())
        )
        wire.send_memory(sock, descriptors)
        self._deliver(peer, notification)
