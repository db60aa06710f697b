"""Doorbells: a rank's transfer thread sleeps until a peer may have sent it something, instead of polling on a
timer.

NIXL gives no way to block until a notification arrives (``get_new_notifs`` only polls), so
every rank also listens on a small UDP socket, its *doorbell*, published with its agent
(:attr:`RankInfo.doorbell_port <pdconnector.worker.identity.RankInfo>`, and in registrations). A
peer rings it right after each notification it sends and after each WRITE or READ of its own it
sees complete (the transfer's notification is then on its way); the ring wakes the rank's transfer
thread, which takes its notifications at once. A doorbell says only "look now": it carries no
data, anybody may ring it, and a lost or spurious ring costs nothing but latency or one idle turn
(the thread still wakes at its idle interval without one). Rings that arrive while a wake-up is
pending are folded into it, so a flood of datagrams costs one turn per turn, not one per datagram.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Final

log = logging.getLogger(__name__)

RING: Final = b"PDDB"
# The receive buffer holds this many rings; more are dropped, which is harmless: one pending wake-up covers
# them all.
_RECV_BYTES: Final = 64


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class Doorbell:
    """Listens on ``host`` (a free UDP port, :attr:`port`) and calls ``on_ring`` on its own thread for each
    ring that is not folded into a pending one; the owner calls :meth:`answered` when it starts the turn a
    ring asked for."""

    def __init__(self, host: str, on_ring: Callable[[], None], *, name: str = "doorbell") -> None:
        self._on_ring = on_ring
        # monotonic time of the last ring (written by the listener, read by the owner)
        self.rung_at = float("-inf")
        self._pending = threading.Event()
        self._closed = threading.Event()
        self._socket = socket.socket(_family(host), socket.SOCK_DGRAM)
        self._socket.bind((host, 0))
        self._address = self._socket.getsockname()[:2]
        self._thread = threading.Thread(target=self._listen, name=name, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._address[1])

    def answered(self) -> None:
        """The woken thread is taking its notifications now: a ring from here on asks for another turn."""
        self._pending.clear()

    def close(self) -> None:
        self._closed.set()
        # Linux does not wake a blocked recvfrom when another thread closes the socket; a ring of our own
        # does.
        with socket.socket(_family(self._address[0]), socket.SOCK_DGRAM) as waker:
            waker.sendto(RING, self._address)
        self._thread.join(timeout=5)
        self._socket.close()

    def _listen(self) -> None:
        while not self._closed.is_set():
            try:
                payload, _ = self._socket.recvfrom(_RECV_BYTES)
            except OSError as error:
                if not self._closed.is_set():
                    log.warning("doorbell on port %d stopped: %s", self.port, error)
                return
            if payload != RING or self._closed.is_set():
                continue
            self.rung_at = time.monotonic()
            if self._pending.is_set():
                continue
            self._pending.set()
            self._on_ring()


class Ringer:
    """Rings peers' doorbells from the transfer thread: one unconnected UDP socket per family, never blocking,
    and a ring that cannot be sent is only logged (the peer then finds the notification at its next idle
    wake-up). Only addresses are rung: a host name would mean a DNS lookup on the transfer thread, which may
    block for seconds, so a peer known by name is left to its idle wake-up (the operator gives engines their
    pod IP)."""

    def __init__(self) -> None:
        self._sockets: dict[socket.AddressFamily, socket.socket] = {}

    def ring(self, host: str, port: int) -> bool:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return False
        family = _family(host)
        sock = self._sockets.get(family)
        if sock is None:
            sock = self._sockets[family] = socket.socket(family, socket.SOCK_DGRAM)
            sock.setblocking(False)
        try:
            sock.sendto(RING, (host, port))
        except OSError as error:
            log.debug("doorbell %s:%d not rung: %s", host, port, error)
            return False
        return True

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()
