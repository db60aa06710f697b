"""Transports: one contract (:mod:`.base`), NIXL (:class:`NixlTransport`) and TCP (:class:`MockTransport`)
implementations."""

from pdconnector.transport.base import (
    MAX_NOTIFICATION_BYTES,
    Device,
    MemoryRegion,
    Operation,
    TransferHandle,
    TransferState,
    TransferStatus,
    Transport,
    TransportError,
)
from pdconnector.transport.descriptors import EMPTY_DESCRIPTORS, RegionTable, as_descriptors, pair_descriptors
from pdconnector.transport.factory import TransportKind, create_transport
from pdconnector.transport.mock import MockTransport
from pdconnector.transport.nixl_transport import NixlTransport, nixl_unavailable_reason

__all__ = [
    "EMPTY_DESCRIPTORS",
    "MAX_NOTIFICATION_BYTES",
    "Device",
    "MemoryRegion",
    "MockTransport",
    "NixlTransport",
    "Operation",
    "RegionTable",
    "TransferHandle",
    "TransferState",
    "TransferStatus",
    "Transport",
    "TransportError",
    "TransportKind",
    "as_descriptors",
    "create_transport",
    "nixl_unavailable_reason",
    "pair_descriptors",
]
