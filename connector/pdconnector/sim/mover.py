"""How the mock engine moves KV blocks between engines: the seam where the connector core's worker plugs in.

A prefill engine *exports* the blocks of a finished prompt (held until a decode engine has them, or a lease
ends); a decode engine *imports* them into blocks it allocated, either by registering and waiting for
prefill's WRITE (push) or by READing the block ids prefill returned through the router (pull). Every import
has a deadline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from pdconnector.protocol.params import (
    TRANSFER_FAILED_CODE,
    TRANSFER_TIMEOUT_CODE,
    PrefillCoordinates,
    TransferMode,
)


class TransferFailed(Exception):
    """An import that did not deliver the KV; ``code`` is what the engine reports to the router."""

    def __init__(self, detail: str, *, timed_out: bool = False, blocks_kept: bool = False) -> None:
        super().__init__(detail)
        self.detail = detail
        self.code = TRANSFER_TIMEOUT_CODE if timed_out else TRANSFER_FAILED_CODE
        self.blocks_kept = (
            blocks_kept  # the mover frees the destination blocks itself, once nothing can land in them
        )


class ExportOutcome(StrEnum):
    SENT = "sent"  # a decode engine has the bytes
    EXPIRED = "expired"  # no decode engine came for them before the lease ended
    FAILED = "failed"  # the transfer was attempted and failed


@dataclass(frozen=True)
class Receipt:
    """What arrived: reported back to the router as the decode leg's proof of transfer."""

    transfer_id: str
    bytes: int
    blocks: int


class KVMover(Protocol):
    """Moves blocks of one engine's ``KVPool`` to or from peers."""

    def side_channel(self) -> PrefillCoordinates:
        """Where decode engines reach this engine's connector (engine id, host, side-channel port, TP)."""
        ...

    async def start(self) -> None: ...

    def peer_agents(self) -> int:
        """Peer agents the transports hold now."""
        ...

    def fenced(self) -> int:
        """Failed imports whose blocks are still held because a peer may still write into them."""
        ...

    async def close(self) -> None: ...

    def export_blocks(
        self,
        transfer_id: str,
        *,
        mode: TransferMode,
        block_ids: list[int],
        num_tokens: int,
        release: Callable[[ExportOutcome], None],
    ) -> None:
        """Prefill: hold ``block_ids`` for a decode engine; call ``release`` exactly once when taken or when
        the mover's lease ends."""
        ...

    async def import_pushed(
        self,
        transfer_id: str,
        *,
        remote: PrefillCoordinates,
        block_ids: list[int],
        num_tokens: int,
        deadline_s: float,
        free: Callable[[], None],
    ) -> Receipt:
        """Push decode: register ``block_ids`` with ``remote`` and wait for its WRITE; raises
        ``TransferFailed``.

        ``free`` frees ``block_ids``. If the import is cancelled, or fails with ``blocks_kept``, the mover
        calls it once nothing can land in the blocks any more, and the caller must not; otherwise the caller
        frees them."""
        ...

    async def import_pulled(
        self,
        transfer_id: str,
        *,
        remote: PrefillCoordinates,
        remote_block_ids: list[int],
        block_ids: list[int],
        num_tokens: int,
        deadline_s: float,
        free: Callable[[], None],
    ) -> Receipt:
        """Pull decode: READ ``remote_block_ids`` of ``remote`` into ``block_ids``; raises ``TransferFailed``;
        ``free`` as for :meth:`import_pushed`."""
        ...
