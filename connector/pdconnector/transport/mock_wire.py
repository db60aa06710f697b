"""MockTransport's wire format: agent metadata (JSON) and length-prefixed frames over TCP, with
registered memory streamed straight from and into place.

Frame: header ``magic(4) kind(1) meta_len(4) stream_len(8)``, then ``meta_len`` bytes of
kind-specific metadata, then ``stream_len`` raw bytes (the memory a WRITE carries or a READ
returns, in descriptor order). Sizes are checked before anything is allocated.
"""

from __future__ import annotations

import ctypes
import json
import select
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from pdconnector.transport.base import MAX_NOTIFICATION_BYTES, Device, MemoryRegion, TransportError

MAGIC = b"PDMT"
WIRE_VERSION = 1
METADATA_KIND = "pdconnector-mock-transport"
MAX_METADATA_BYTES = 4 << 20
MAX_DESCRIPTORS = 1 << 20
MAX_META_BYTES = MAX_DESCRIPTORS * 24 + MAX_NOTIFICATION_BYTES + 64
# Small descriptors are batched through a staging buffer of this size instead of one syscall each.
STAGING_BYTES = 1 << 20

_HEADER = struct.Struct("!4sBIQ")
_TRANSFER = struct.Struct("!QI")
_ACK = struct.Struct("!QB")


class FrameKind(IntEnum):
    HELLO = 1
    WRITE = 2
    READ = 3
    NOTIFY = 4
    ACK = 5


class WireError(Exception):
    """The byte stream broke the protocol or the connection ended; the connection is unusable."""


@dataclass(frozen=True)
class PeerInfo:
    name: str
    host: str
    port: int
    regions: tuple[MemoryRegion, ...]


def encode_metadata(name: str, host: str, port: int, regions: Sequence[MemoryRegion]) -> bytes:
    body = {
        "kind": METADATA_KIND,
        "version": WIRE_VERSION,
        "name": name,
        "host": host,
        "port": port,
        "regions": [[r.addr, r.nbytes, r.device_id] for r in regions],
    }
    return json.dumps(body, separators=(",", ":")).encode()


def decode_metadata(metadata: bytes) -> PeerInfo:
    """Parse a peer's metadata, naming the offending field on any error."""
    if len(metadata) > MAX_METADATA_BYTES:
        raise TransportError(f"peer metadata of {len(metadata)} bytes exceeds {MAX_METADATA_BYTES}")
    try:
        body = json.loads(metadata)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TransportError(
            f"peer metadata is not MockTransport metadata (not JSON: {error}); was it produced by another "
            "transport?"
        ) from None
    if not isinstance(body, dict) or body.get("kind") != METADATA_KIND:
        raise TransportError(
            "peer metadata is not MockTransport metadata "
            f"(kind={body.get('kind') if isinstance(body, dict) else None!r})"
        )
    if body.get("version") != WIRE_VERSION:
        raise TransportError(
            f"peer metadata version {body.get('version')!r} is not supported (expected {WIRE_VERSION})"
        )
    name, host, port, regions = body.get("name"), body.get("host"), body.get("port"), body.get("regions")
    if not isinstance(name, str) or not name:
        raise TransportError(f"peer metadata field 'name' must be a non-empty string, got {name!r}")
    if not isinstance(host, str) or not host:
        raise TransportError(f"peer metadata field 'host' must be a non-empty string, got {host!r}")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise TransportError(f"peer metadata field 'port' must be a TCP port, got {port!r}")
    if not isinstance(regions, list) or not all(
        isinstance(r, list) and len(r) == 3 and all(isinstance(v, int) for v in r) for r in regions
    ):
        raise TransportError(
            "peer metadata field 'regions' must be a list of [addr, nbytes, device_id] integer triples"
        )
    return PeerInfo(name, host, port, tuple(MemoryRegion(a, n, Device.DRAM, d) for a, n, d in regions))


def memory_view(addr: int, nbytes: int) -> memoryview:
    """A writable byte view of raw process memory (already checked to be registered)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def encode_transfer(transfer_id: int, notification: bytes, descriptors: np.ndarray) -> bytes:
    return _TRANSFER.pack(transfer_id, len(notification)) + notification + descriptors.astype("<i8").tobytes()


def decode_transfer(meta: bytes) -> tuple[int, bytes, np.ndarray]:
    if len(meta) < _TRANSFER.size:
        raise WireError(f"transfer frame metadata of {len(meta)} bytes is truncated")
    transfer_id, notification_len = _TRANSFER.unpack_from(meta)
    rest = len(meta) - _TRANSFER.size - notification_len
    if notification_len > MAX_NOTIFICATION_BYTES or rest < 0 or rest % 24:
        raise WireError(
            f"transfer frame {transfer_id}: inconsistent sizes (notification {notification_len}, descriptor "
            f"bytes {rest})"
        )
    notification = meta[_TRANSFER.size : _TRANSFER.size + notification_len]
    descriptors = (
        np.frombuffer(meta, dtype="<i8", offset=_TRANSFER.size + notification_len)
        .reshape(-1, 3)
        .astype(np.int64)
    )
    return transfer_id, notification, descriptors


def encode_ack(transfer_id: int, error: str) -> bytes:
    return _ACK.pack(transfer_id, 0 if error else 1) + error.encode()[:4096]


def decode_ack(meta: bytes) -> tuple[int, str]:
    """``(transfer id, error)``; an empty error means success."""
    if len(meta) < _ACK.size:
        raise WireError(f"ack frame metadata of {len(meta)} bytes is truncated")
    transfer_id, ok = _ACK.unpack_from(meta)
    error = meta[_ACK.size :].decode(errors="replace")
    return transfer_id, "" if ok else error or "rejected by peer"


def send_frame(sock: socket.socket, kind: FrameKind, meta: bytes = b"", stream_len: int = 0) -> None:
    """Send header and metadata; the caller streams ``stream_len`` bytes right after."""
    sock.sendall(_HEADER.pack(MAGIC, kind, len(meta), stream_len) + meta)


def recv_frame(sock: socket.socket) -> tuple[FrameKind, bytes, int]:
    """``(kind, meta, stream_len)`` of the next frame; the stream is left on the socket.

    Waits without a deadline for the frame to start (a connection may idle indefinitely; closing
    or shutting down the socket ends the wait), then reads it within the socket's timeout."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poller.poll()
    magic, kind, meta_len, stream_len = _HEADER.unpack(recv_exact(sock, _HEADER.size))
    if magic != MAGIC:
        raise WireError(f"bad frame magic {magic!r}")
    if kind not in FrameKind.__members__.values():
        raise WireError(f"unknown frame kind {kind}")
    if meta_len > MAX_META_BYTES:
        raise WireError(f"frame metadata of {meta_len} bytes exceeds {MAX_META_BYTES}")
    return FrameKind(kind), recv_exact(sock, meta_len), stream_len


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    buffer = bytearray(nbytes)
    _recv_into(sock, memoryview(buffer))
    return bytes(buffer)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        received = sock.recv_into(view)
        if received == 0:
            raise WireError("connection closed by peer")
        view = view[received:]


def send_memory(sock: socket.socket, descriptors: np.ndarray) -> None:
    """Stream the bytes of every descriptor, in order."""
    staging = bytearray(STAGING_BYTES)
    staging_addr = ctypes.addressof(ctypes.c_char.from_buffer(staging))
    fill = 0
    for addr, nbytes in descriptors[:, :2].tolist():
        if fill and fill + nbytes > STAGING_BYTES:
            sock.sendall(memoryview(staging)[:fill])
            fill = 0
        if nbytes >= STAGING_BYTES:
            sock.sendall(memory_view(addr, nbytes))
        else:
            ctypes.memmove(staging_addr + fill, addr, nbytes)
            fill += nbytes
    if fill:
        sock.sendall(memoryview(staging)[:fill])


def recv_memory(sock: socket.socket, descriptors: np.ndarray) -> None:
    """Receive the stream :func:`send_memory` produced straight into every descriptor, in order."""
    staging = bytearray(STAGING_BYTES)
    staging_addr = ctypes.addressof(ctypes.c_char.from_buffer(staging))
    batch: list[tuple[int, int]] = []
    fill = 0

    def flush() -> None:
        _recv_into(sock, memoryview(staging)[:fill])
        offset = 0
        for addr, nbytes in batch:
            ctypes.memmove(addr, staging_addr + offset, nbytes)
            offset += nbytes
        batch.clear()

    for addr, nbytes in descriptors[:, :2].tolist():
        if fill and fill + nbytes > STAGING_BYTES:
            flush()
            fill = 0
        if nbytes >= STAGING_BYTES:
            _recv_into(sock, memory_view(addr, nbytes))
        else:
            batch.append((addr, nbytes))
            fill += nbytes
    if fill:
        flush()


def discard(sock: socket.socket, nbytes: int) -> None:
    scratch = memoryview(bytearray(min(nbytes, STAGING_BYTES)))
    while nbytes:
        chunk = scratch[: min(nbytes, scratch.nbytes)]
        _recv_into(sock, chunk)
        nbytes -= chunk.nbytes
