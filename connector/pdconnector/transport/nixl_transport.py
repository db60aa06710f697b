"""NixlTransport: the transport contract on NIXL 1.5 (``nixl._api``).

The agent is created without NIXL's progress thread: with it, UCX's shared progress thread polls
with a zero timeout and burns a core per agent even when idle. Progress therefore happens only in
the owner's calls (``state``, ``progress``, ``take_notifications``), which must come regularly
(see :mod:`pdconnector.transport.base`).

Each transfer is built with ``initialize_xfer`` from the caller's descriptor arrays. Measured here
(two agents, host memory, median of 30): building the request costs 7-12 us for 1-64 descriptors,
34-95 us for 1024 and ~400 us for 16384; preparing both lists with ``prep_xfer_dlist`` and then
``make_prepped_xfer`` costs 10-50 % more when the lists are used once, and even lists prepared once
and reused save only 15-20 % at 16384 descriptors, while the transfer itself costs 10-100x more.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from pdconnector.transport.base import (
    MAX_NOTIFICATION_BYTES,
    Device,
    MemoryRegion,
    Operation,
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

# The largest notification each backend delivers. LIBFABRIC serialises a notification into one 8 KiB control
# buffer (NIXL_LIBFABRIC_SEND_RECV_BUFFER_SIZE) with a header and the sender's agent name; 7 KiB leaves room
# for both.
NOTIFICATION_LIMITS: Final = {"LIBFABRIC": 7 * 1024}

# Our metadata wraps NIXL's so a peer learns the memory kind of our regions (NIXL needs it to
# describe the remote side) and so metadata from another transport fails with a clear error.
_METADATA_MAGIC = b"pdconnector-nixl/1\n"
_DONE = TransferStatus(TransferState.DONE)
_IN_PROGRESS = TransferStatus(TransferState.IN_PROGRESS)


def nixl_unavailable_reason() -> str | None:
    """Why NIXL cannot be used in this environment, or None when ``nixl._api`` imports."""
    try:
        import nixl._api  # noqa: F401, PLC0415
    except Exception as error:
        return f"nixl is not importable: {type(error).__name__}: {error}"
    return None


@dataclass
class _Transfer:
    handle: TransferHandle
    xfer: Any | None  # nixl_xfer_handle; None once NIXL has nothing left to track
    status: TransferStatus


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class NixlTransport(Transport):
    """Args:
    name: NIXL agent name (engine id + rank), unique among the agents that talk to each other.
    backends: NIXL backends to create, e.g. ``("UCX",)`` here or ``("LIBFABRIC",)`` on EFA.
    num_threads: worker threads for backends that support them (0 = backend default).
    """

    def __init__(self, name: str, *, backends: Sequence[str] = ("UCX",), num_threads: int = 0) -> None:
        super().__init__(
            name,
            notification_limit=min(
                (NOTIFICATION_LIMITS.get(b, MAX_NOTIFICATION_BYTES) for b in backends), default=1
            ),
        )
        try:
            from nixl._api import nixl_agent, nixl_agent_config  # noqa: PLC0415 (nixl is optional)
        except Exception as error:
            raise TransportError(f"NixlTransport needs the nixl package: {_describe(error)}") from None
        if not backends:
            raise TransportError("NixlTransport needs at least one backend")
        config = nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=list(backends),
            num_threads=num_threads,
        )
        try:
            self._agent = nixl_agent(name, config)
        except Exception as error:
            raise TransportError(f"cannot create NIXL agent {name!r}: {_describe(error)}") from None
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise TransportError(
                f"NIXL backend(s) {missing} unavailable; plugins found: {self._agent.get_plugin_list()}"
            )
        self._regions = RegionTable()
        self._registrations: list[Any] = []
        self._peers: dict[str, Device] = {}
        self._transfers: TransferTable[_Transfer] = TransferTable(f"NIXL agent {name!r}")
        self._inbox: list[tuple[str, bytes]] = []
        self._ids = itertools.count(1)

    @property
    def _device(self) -> Device:
        return self._regions.device or Device.DRAM

    @confined
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        if not regions:
            return
        table = RegionTable([*self._regions.regions, *regions])
        try:
            registration = self._agent.register_memory(
                [(r.addr, r.nbytes, r.device_id, "") for r in regions], regions[0].device.value
            )
        except Exception as error:
            raise TransportError(
                f"NIXL agent {self.name!r}: cannot register {len(regions)} region(s): {_describe(error)}"
            ) from None
        self._registrations.append(registration)
        self._regions = table

    @confined
    def metadata(self) -> bytes:
        header = json.dumps({"device": self._device.value}).encode()
        return _METADATA_MAGIC + header + b"\n" + self._agent.get_agent_metadata()

    @confined
    def add_peer(self, metadata: bytes) -> str:
        device, nixl_metadata = self._parse_metadata(metadata)
        try:
            name = self._load_peer(nixl_metadata)
            if name in self._peers:
                # A restarted peer reuses its name: drop the old endpoint so no stale connection survives.
                self._agent.remove_remote_agent(name)
                name = self._load_peer(nixl_metadata)
        except Exception as error:
            raise TransportError(
                f"NIXL agent {self.name!r}: cannot load peer metadata: {_describe(error)}"
            ) from None
        self._peers[name] = device
        return name

    @confined
    def remove_peer(self, peer: str) -> None:
        self._peer_device(peer)
        self._flush_failed_requests()
        del self._peers[peer]
        for transfer in self._transfers.values():
            if transfer.handle.peer == peer and not transfer.status.finished:
                transfer.status = TransferStatus(TransferState.FAILED, f"peer {peer!r} removed")
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as error:
            raise TransportError(
                f"NIXL agent {self.name!r}: cannot remove peer {peer!r}: {_describe(error)}"
            ) from None

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
        transfer = self._transfers.of(handle)
        if transfer.status.finished or transfer.xfer is None:
            return transfer.status
        try:
            state = self._agent.check_xfer_state(transfer.xfer)
        except Exception as error:
            transfer.status = TransferStatus(TransferState.FAILED, _describe(error))
            return transfer.status
        if state == "DONE":
            transfer.status = _DONE
        elif state != "PROC":
            transfer.status = TransferStatus(TransferState.FAILED, f"NIXL reported transfer state {state}")
        return transfer.status

    @confined
    def release(self, handle: TransferHandle) -> None:
        transfer = self._transfers.of(handle)
        if transfer.xfer is not None:
            try:
                transfer.xfer.release()
            except Exception as error:
                raise TransportError(
                    f"transfer {handle.id} to {handle.peer!r} cannot be released (in flight?): "
                    f"{_describe(error)}"
                ) from None
        del self._transfers[handle.id]

    @confined
    def notify(self, peer: str, message: bytes) -> None:
        message = check_notification(message, self.notification_limit)
        self._peer_device(peer)
        try:
            self._agent.send_notif(peer, message)
        except Exception as error:
            raise TransportError(
                f"NIXL agent {self.name!r}: cannot notify peer {peer!r}: {_describe(error)}"
            ) from None

    @confined
    def progress(self) -> None:
        try:
            arrived = self._agent.get_new_notifs()
        except Exception as error:
            raise TransportError(
                f"NIXL agent {self.name!r}: polling notifications failed: {_describe(error)}"
            ) from None
        self._collect(arrived)

    @confined
    def take_notifications(self) -> list[tuple[str, bytes]]:
        self.progress()
        taken, self._inbox = self._inbox, []
        return taken

    def close(self) -> None:
        if self._closed:
            return
        self._check_usable("close")
        self._closed = True
        for transfer in self._transfers.values():
            if transfer.xfer is not None:
                with contextlib.suppress(Exception):
                    transfer.xfer.release()
        self._transfers.clear()
        self._flush_failed_requests()
        for peer in list(self._peers):
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(peer)
        self._peers.clear()
        for registration in self._registrations:
            self._agent.deregister_memory(registration)
        self._registrations.clear()
        del self._agent

    # -- helpers ----------------------------------------------------------------------------

    def _flush_failed_requests(self) -> None:
        """One round of UCX progress before tearing endpoints down.

        Found here (NIXL 1.5.1, UCX without progress thread): when a post to a dead peer failed and
        the endpoint is destroyed before the worker progressed again, UCX aborts the process
        (``ucs_arbiter_group_is_empty`` assertion); a single progress call in between avoids it.
        Notifications collected here are kept for :meth:`take_notifications`."""
        with contextlib.suppress(Exception):
            self._collect(self._agent.get_new_notifs())

    def _collect(self, arrived: dict[str, list[bytes]]) -> None:
        for peer, messages in arrived.items():
            name = peer.decode() if isinstance(peer, bytes) else peer
            self._inbox.extend((name, bytes(m)) for m in messages)

    def _parse_metadata(self, metadata: bytes) -> tuple[Device, bytes]:
        if not metadata.startswith(_METADATA_MAGIC):
            hint = " (it looks like MockTransport metadata)" if metadata[:1] == b"{" else ""
            raise TransportError(f"peer metadata is not NixlTransport metadata{hint}")
        header, _, nixl_metadata = metadata[len(_METADATA_MAGIC) :].partition(b"\n")
        try:
            return Device(json.loads(header)["device"]), nixl_metadata
        except (ValueError, KeyError, TypeError) as error:
            raise TransportError(
                f"peer metadata header {header[:100]!r} is malformed: {_describe(error)}"
            ) from None

    def _load_peer(self, nixl_metadata: bytes) -> str:
        name = self._agent.add_remote_agent(nixl_metadata)
        return name.decode() if isinstance(name, bytes) else name

    def _peer_device(self, peer: str) -> Device:
        device = self._peers.get(peer)
        if device is None:
            raise TransportError(
                f"NIXL agent {self.name!r}: unknown peer {peer!r}; add it with add_peer(metadata) first"
            )
        return device

    def _post(
        self, operation: Operation, peer: str, local: np.ndarray, remote: np.ndarray, notification: bytes
    ) -> TransferHandle:
        remote_device = self._peer_device(peer)
        local, remote = pair_descriptors(local, remote)
        notification = check_notification(notification, self.notification_limit)
        self._regions.check(local, "local", self.name)
        handle = TransferHandle(next(self._ids), peer, operation, int(local.shape[0]), int(local[:, 1].sum()))
        transfer = _Transfer(handle, None, _IN_PROGRESS)
        if local.shape[0] == 0:
            transfer.status = self._notify_only(peer, notification)
            self._transfers[handle.id] = transfer
            return handle
        try:
            transfer.xfer = self._agent.initialize_xfer(
                operation.value,
                self._agent.get_xfer_descs(local, self._device.value),
                self._agent.get_xfer_descs(remote, remote_device.value),
                peer,
                notification,
            )
        except Exception as error:
            if type(error).__name__ != "nixlRemoteDisconnectError":
                # NIXL answers NOT_FOUND when no backend holds a registration covering every descriptor;
                # the local side was checked above, so the remote descriptors are at fault.
                raise TransportError(
                    f"NIXL agent {self.name!r}: cannot build {operation.value} to {peer!r} "
                    f"(remote descriptors outside the memory {peer!r} registered?): {_describe(error)}"
                ) from None
            transfer.status = TransferStatus(
                TransferState.FAILED, f"peer {peer!r} is disconnected: {_describe(error)}"
            )
        self._transfers[handle.id] = transfer
        if transfer.xfer is None:
            return handle
        try:
            state = self._agent.transfer(transfer.xfer)
        except Exception as error:
            transfer.status = TransferStatus(
                TransferState.FAILED, f"posting to {peer!r} failed: {_describe(error)}"
            )
            return handle
        if state == "DONE":
            transfer.status = _DONE
        elif state != "PROC":
            transfer.status = TransferStatus(
                TransferState.FAILED, f"posting to {peer!r} failed: NIXL state {state}"
            )
        return handle

    def _notify_only(self, peer: str, notification: bytes) -> TransferStatus:
        if not notification:
            return _DONE
        try:
            self._agent.send_notif(peer, notification)
        except Exception as error:
            return TransferStatus(TransferState.FAILED, f"notifying {peer!r} failed: {_describe(error)}")
        return _DONE
