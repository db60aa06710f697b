"""The engine-level handshake: one small TCP server per engine serving its ranks' agents, and a caching
client.

Decode needs prefill's agent metadata (to register, and to READ in pull mode) and prefill needs
decode's (to WRITE and to answer). One request does both: the client sends its own
:class:`EngineInfo` (the *announce*), the server hands it to ``on_announce`` (the prefill engine
loads those peers into its rank workers) and answers with its own. Frames are
``MAGIC`` + 4-byte big-endian length + msgpack, bounded in both directions. A frame must arrive whole
within one deadline (a peer that trickles bytes cannot hold a connection open), and the server
serves at most ``max_connections`` at once, closing the ones beyond at once.

The client caches by address and refetches when the engine id it is asked for is not the one
it cached, or the incarnation (one start of the engine) is not: a restarted engine keeps its engine id
but gets a new incarnation and new agent names, and its old NIXL peer state must not be used; a lookup
naming an incarnation (a pull, whose blocks one start holds) fails with :class:`PeerGone` when another
runs there. Lookups run on a small thread pool and return futures, so neither the
engine step nor the transfer thread waits for the network; ``prewarm`` fetches a peer before its
first request.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Final

import msgspec

from pdconnector.protocol.params import PrefillCoordinates
from pdconnector.worker.identity import EngineInfo

log = logging.getLogger(__name__)

MAGIC: Final = b"PDSC"
VERSION: Final = 1
MAX_FRAME_BYTES: Final = 8 << 20
# Peers connect once per engine they look up (and again after a restart): far below this in any deployment.
DEFAULT_MAX_CONNECTIONS: Final = 64
_HEADER = struct.Struct(">4sI")


class SideChannelError(ConnectionError):
    """The side channel of ``address`` could not be used; the message says why."""


class PeerGone(SideChannelError):
    """Nobody listens at the address any more, or another engine does: the engine looked up is not running
    there (a frozen one still accepts connections, so it is never reported gone)."""


class _Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: Annotated[int, msgspec.Meta(ge=0)]
    announce: EngineInfo | None = None


class _Reply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    engine: EngineInfo | None = None
    error: Annotated[str, msgspec.Meta(max_length=4096)] = ""


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(_Request)
_reply_decoder = msgspec.msgpack.Decoder(_Reply)


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    if len(payload) > MAX_FRAME_BYTES:
        raise SideChannelError(
            f"side-channel frame of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit"
        )
    sock.sendall(_HEADER.pack(MAGIC, len(payload)) + payload)


def _recv_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SideChannelError(f"frame not received by its deadline ({len(chunks)} of {size} bytes)")
        sock.settimeout(remaining)
        chunk = sock.recv(min(size - len(chunks), 1 << 20))
        if not chunk:
            raise SideChannelError(f"connection closed after {len(chunks)} of {size} bytes")
        chunks += chunk
    return bytes(chunks)


def _recv_frame(sock: socket.socket, timeout_s: float) -> bytes:
    """One whole frame within ``timeout_s``, however the bytes are spread over time."""
    deadline = time.monotonic() + timeout_s
    magic, size = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if magic != MAGIC:
        raise SideChannelError(f"not a pdconnector side channel (magic {magic!r})")
    if size > MAX_FRAME_BYTES:
        raise SideChannelError(f"side-channel frame of {size} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return _recv_exact(sock, size, deadline)


class SideChannelServer:
    """Serves ``engine_info()`` on ``host:port`` (port 0 picks a free one; see :attr:`port`)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        engine_info: Callable[[], EngineInfo],
        on_announce: Callable[[EngineInfo], None] | None = None,
        io_timeout_s: float = 5.0,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                if not outer._slots.acquire(blocking=False):
                    log.warning(
                        "side channel: %d connections open, refused one from %s",
                        max_connections,
                        self.client_address,
                    )
                    return
                try:
                    outer._serve(self.request)
                finally:
                    outer._slots.release()

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._engine_info = engine_info
        self._on_announce = on_announce
        self._io_timeout_s = io_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._server = Server((host, port), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"side-channel-{port}",
            daemon=True,
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> SideChannelServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(self._io_timeout_s)
        try:
            try:
                request = _request_decoder.decode(_recv_frame(sock, self._io_timeout_s))
            except (msgspec.ValidationError, msgspec.DecodeError) as error:
                _send_frame(
                    sock, _encoder.encode(_Reply(error=f"malformed side-channel request: {error}"[:4096]))
                )
                return
            if request.version != VERSION:
                _send_frame(
                    sock,
                    _encoder.encode(
                        _Reply(
                            error=f"side-channel version {request.version} is not supported (server speaks "
                            f"{VERSION})"
                        )
                    ),
                )
                return
            if request.announce is not None and self._on_announce is not None:
                self._on_announce(request.announce)
            try:
                reply = _Reply(engine=self._engine_info())
            except RuntimeError as error:  # the engine is still starting
                reply = _Reply(error=str(error)[:4096])
            _send_frame(sock, _encoder.encode(reply))
        except (OSError, SideChannelError) as error:
            log.info("side channel: dropped a connection: %s", error)


def fetch_engine_info(
    host: str, port: int, *, timeout_s: float, announce: EngineInfo | None = None
) -> EngineInfo:
    """One handshake with the side channel at ``host:port`` (blocking, bounded by ``timeout_s`` per socket
    operation)."""
    address = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            _send_frame(sock, _encoder.encode(_Request(VERSION, announce)))
            raw = _recv_frame(sock, timeout_s)
    except SideChannelError as error:
        raise SideChannelError(f"side channel {address}: {error}") from None
    except ConnectionRefusedError as error:
        raise PeerGone(f"side channel {address} unreachable: {error}") from None
    except OSError as error:
        raise SideChannelError(f"side channel {address} unreachable: {error}") from None
    try:
        reply = _reply_decoder.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise SideChannelError(f"side channel {address} sent a malformed reply: {error}") from None
    if reply.engine is None:
        raise SideChannelError(f"side channel {address} refused the handshake: {reply.error}")
    return reply.engine


@dataclass
class _Cached:
    expected_engine_id: str
    expected_incarnation: str
    future: Future[EngineInfo]

    def serves(self, peer: PrefillCoordinates) -> bool:
        """Whether this lookup answers for ``peer``: the same engine id, not failed, and the incarnation asked
        for (any, when ``peer`` names none)."""
        if self.expected_engine_id != peer.engine_id or _failed(self.future):
            return False
        if not peer.incarnation or self.expected_incarnation == peer.incarnation:
            return True
        return self.future.done() and self.future.result().incarnation == peer.incarnation


class SideChannelClient:
    """Resolves prefill coordinates to :class:`EngineInfo`, caching per address; thread-safe."""

    def __init__(
        self,
        *,
        announce: Callable[[], EngineInfo] | None = None,
        timeout_s: float = 5.0,
        max_workers: int = 2,
    ) -> None:
        self._announce = announce
        self._timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="side-channel-client")
        # Probes of peers that went silent may each wait out the timeout (a frozen peer accepts and never
        # answers): they get their own thread, so handshakes of new transfers never queue behind them.
        self._probe_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="side-channel-probe")
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, int], _Cached] = {}
        self._probes: dict[tuple[str, int], Future[EngineInfo]] = {}

    def lookup(self, peer: PrefillCoordinates) -> Future[EngineInfo]:
        """The peer's info: cached if the cached engine (and incarnation, where ``peer`` names one) is the one
        asked for, fetched otherwise."""
        key = (peer.host, peer.side_channel_port)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached.serves(peer):
                return cached.future
            future = self._pool.submit(self._fetch, peer)
            self._cache[key] = _Cached(peer.engine_id, peer.incarnation, future)
            return future

    prewarm = lookup

    def invalidate(self, peer: PrefillCoordinates) -> None:
        """Forget the cached info (e.g. after a transfer error with that peer); the next lookup fetches
        again."""
        with self._lock:
            self._cache.pop((peer.host, peer.side_channel_port), None)

    def probe(self, peer: PrefillCoordinates) -> Future[EngineInfo]:
        """A fresh look at the peer (not the cache): fails with :class:`PeerGone` when it is not running there
        any more. Callers probing one address at the same time share one probe."""
        key = (peer.host, peer.side_channel_port)
        with self._lock:
            running = self._probes.get(key)
            if running is not None and not running.done():
                return running
            future = self._probe_pool.submit(self._fetch, peer)
            self._probes[key] = future
            return future

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._probe_pool.shutdown(wait=False, cancel_futures=True)

    def _fetch(self, peer: PrefillCoordinates) -> EngineInfo:
        announce = self._announce() if self._announce is not None else None
        info = fetch_engine_info(
            peer.host, peer.side_channel_port, timeout_s=self._timeout_s, announce=announce
        )
        if info.engine_id != peer.engine_id:
            raise PeerGone(
                f"side channel {peer.host}:{peer.side_channel_port} serves engine {info.engine_id!r}, not "
                f"{peer.engine_id!r} (restarted or replaced)"
            )
        if peer.incarnation and info.incarnation != peer.incarnation:
            raise PeerGone(
                f"engine {peer.engine_id} restarted: incarnation {info.incarnation or '<unnamed>'} runs "
                f"there, the request's blocks were held by incarnation {peer.incarnation}"
            )
        if info.tp_size != peer.tp_size:
            raise SideChannelError(
                f"engine {peer.engine_id} has TP size {info.tp_size}, the request says {peer.tp_size}"
            )
        return info


def _failed(future: Future[EngineInfo]) -> bool:
    return future.done() and (future.cancelled() or future.exception() is not None)
