"""Choose a transport by name, as configured for an engine (``--transport mock|nixl``)."""

from __future__ import annotations

from typing import Any, Literal

from pdconnector.transport.base import Transport, TransportError
from pdconnector.transport.mock import MockTransport
from pdconnector.transport.nixl_transport import NixlTransport

TransportKind = Literal["mock", "nixl"]


def create_transport(kind: TransportKind, name: str, **options: Any) -> Transport:
    """A new agent of that kind; ``options`` go to the class (e.g. ``backends`` for NIXL, ``host``/``port``
    for the mock)."""
    if kind == "nixl":
        return NixlTransport(name, **options)
    if kind == "mock":
        return MockTransport(name, **options)
    raise TransportError(f"unknown transport kind {kind!r}; expected 'mock' or 'nixl'")
