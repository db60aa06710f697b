"""The transport contract: registered memory, one-sided WRITE/READ with a completion notification,
plain notifications, polled completion.

Thread rule: an agent is confined to one thread (NIXL agents are created without internal locking
and without a progress thread). The thread that constructs a transport owns it; every public
method raises :class:`TransportError` when called from another thread. Ownership moves only by an
explicit hand-off, :meth:`Transport.bind_to_current_thread`, called by the new owner after the old
owner has stopped using the agent (e.g. construct on the engine thread, hand over to the transfer
worker through a queue).

Progress rule: nothing happens in the background on behalf of a NIXL agent. Its owner must call
:meth:`Transport.progress` (or :meth:`Transport.take_notifications`, :meth:`Transport.state`)
regularly while peers may transfer into it, it has transfers in flight or it has just sent
notifications (NIXL sends them asynchronously): that is what completes incoming transfers,
outgoing notifications and connection set-up. Found here: a NIXL agent whose owner stops
progressing while a peer connects can leave that peer's endpoint permanently disconnected. Poll
with back-off when idle instead of spinning.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import wraps
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import numpy as np

# A notification carries a registration or a completion id; anything near this size is a bug upstream.
MAX_NOTIFICATION_BYTES = 1 << 20


class TransportError(Exception):
    """A transport call that cannot be carried out: unknown peer, invalid descriptors, wrong thread, closed
    agent."""


class PeerUnreachable(TransportError):
    """A peer's agent did not answer where its metadata says it is (gone, or a restarted engine's old
    agent)."""


class Device(StrEnum):
    """Memory kind of a registered region, named as NIXL names them."""

    DRAM = "DRAM"
    VRAM = "VRAM"


@dataclass(frozen=True)
class MemoryRegion:
    """A contiguous range of memory an agent exposes to its peers."""

    addr: int
    nbytes: int
    device: Device = Device.DRAM
    device_id: int = 0

    def __post_init__(self) -> None:
        if self.addr <= 0:
            raise TransportError(f"MemoryRegion.addr must be a positive address, got {self.addr}")
        if self.nbytes <= 0:
            raise TransportError(f"MemoryRegion.nbytes must be positive, got {self.nbytes}")
        if self.device_id < 0:
            raise TransportError(f"MemoryRegion.device_id must be >= 0, got {self.device_id}")
        object.__setattr__(self, "device", Device(self.device))


class Operation(StrEnum):
    WRITE = "WRITE"
    READ = "READ"


class TransferState(StrEnum):
    IN_PROGRESS = "IN_PROGRESS"
    DONE = "DONE"
    FAILED = "FAILED"


@dataclass(frozen=True)
class TransferStatus:
    state: TransferState
    error: str = ""

    @property
    def finished(self) -> bool:
        return self.state is not TransferState.IN_PROGRESS


@dataclass(frozen=True)
class TransferHandle:
    """Names one posted transfer of one agent; pass it back to ``state`` and ``release``."""

    id: int
    peer: str
    operation: Operation
    num_descriptors: int
    nbytes: int


class _HoldsHandle(Protocol):
    handle: TransferHandle


_Tracked = TypeVar("_Tracked", bound=_HoldsHandle)


class TransferTable(dict[int, _Tracked]):
    """A transport's transfers in flight by handle id."""

    def __init__(self, owner: str) -> None:
        super().__init__()
        self.owner = owner

    def of(self, handle: TransferHandle) -> _Tracked:
        """The transfer ``handle`` names; a released or foreign handle is a :class:`TransportError`."""
        transfer = self.get(handle.id)
        if transfer is None or transfer.handle != handle:
            raise TransportError(f"{self.owner}: unknown or released transfer handle {handle.id}")
        return transfer


_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T", bound="Transport")


def confined(method: Callable[Concatenate[_T, _P], _R]) -> Callable[Concatenate[_T, _P], _R]:
    """Guard a public method: owner thread only, and not after ``close``."""

    @wraps(method)
    def guarded(self: _T, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        self._check_usable(method.__name__)
        return method(self, *args, **kwargs)

    return guarded


class Transport(ABC):
    """One agent: registered memory, peers, transfers and notifications. Subclasses guard every
    public method with :func:`confined`."""

    def __init__(self, name: str, *, notification_limit: int = MAX_NOTIFICATION_BYTES) -> None:
        """``notification_limit``: the largest notification the backend delivers (bytes)."""
        if not name or len(name) > 256:
            raise TransportError(f"agent name must be 1..256 characters, got {name!r}")
        if not 0 < notification_limit <= MAX_NOTIFICATION_BYTES:
            raise TransportError(
                f"notification limit must be in (0, {MAX_NOTIFICATION_BYTES}], got {notification_limit}"
            )
        self.name = name
        self.notification_limit = notification_limit
        self._owner = threading.get_ident()
        self._closed = False

    def bind_to_current_thread(self) -> None:
        """Hand the agent over to the calling thread (the previous owner must no longer use it)."""
        self._owner = threading.get_ident()

    def _check_usable(self, method: str) -> None:
        if threading.get_ident() != self._owner:
            raise TransportError(
                f"{type(self).__name__} {self.name!r}: {method}() called from thread "
                f"{threading.get_ident()} but the agent is confined "
                f"to thread {self._owner}; hand it over with bind_to_current_thread()"
            )
        if self._closed:
            raise TransportError(f"{type(self).__name__} {self.name!r}: {method}() called after close()")

    @abstractmethod
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Expose memory to peers. Register before handing out :meth:`metadata`; all regions of
        one agent share one device kind."""

    @abstractmethod
    def metadata(self) -> bytes:
        """What a peer passes to :meth:`add_peer` to reach this agent (address and registered regions)."""

    @abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata (replacing an earlier copy under the same name); returns its name."""

    @abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a peer and disconnect from it; its in-flight transfers end FAILED."""

    @abstractmethod
    def write(
        self, peer: str, local: np.ndarray, remote: np.ndarray, notification: bytes = b""
    ) -> TransferHandle:
        """Post one WRITE of every ``local`` descriptor into the matching ``remote`` descriptor.

        Descriptors are ``(N, 3)`` int64 rows ``[addr, nbytes, device_id]``; row ``i`` of both
        arrays has the same length. ``notification`` (if not empty) reaches the peer's
        :meth:`take_notifications` once, after all bytes landed. An empty descriptor list only
        delivers the notification. Raises :class:`TransportError` for invalid requests (unknown
        peer, malformed descriptors, memory outside the registered regions); failures on the
        wire (peer gone, rejected) show up as a FAILED :meth:`state`.
        """

    @abstractmethod
    def read(
        self, peer: str, local: np.ndarray, remote: np.ndarray, notification: bytes = b""
    ) -> TransferHandle:
        """Post one READ of every ``remote`` descriptor into the matching ``local`` descriptor;
        ``notification`` reaches the peer once the bytes were read. Same rules as :meth:`write`."""

    @abstractmethod
    def state(self, handle: TransferHandle) -> TransferStatus:
        """Poll a transfer (also makes progress). DONE and FAILED are final."""

    @abstractmethod
    def release(self, handle: TransferHandle) -> None:
        """Free a transfer's resources; releasing one still in progress tries to cancel it and
        raises :class:`TransportError` (handle kept) if the transfer cannot be stopped."""

    @abstractmethod
    def notify(self, peer: str, message: bytes) -> None:
        """Send a standalone notification."""

    @abstractmethod
    def progress(self) -> None:
        """Drive incoming transfers and collect notifications; call regularly from the owner thread."""

    @abstractmethod
    def take_notifications(self) -> list[tuple[str, bytes]]:
        """Every ``(peer name, message)`` received since the last call, in arrival order per peer."""

    @abstractmethod
    def close(self) -> None:
        """Tear the agent down; further calls raise :class:`TransportError`. Idempotent."""

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def check_notification(message: bytes, limit: int = MAX_NOTIFICATION_BYTES) -> bytes:
    if not isinstance(message, bytes | bytearray | memoryview):
        raise TransportError(f"notification must be bytes, got {type(message).__name__}")
    if len(message) > limit:
        raise TransportError(
            f"notification of {len(message)} bytes exceeds the transport's limit of {limit} bytes"
        )
    return bytes(message)
