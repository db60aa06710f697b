"""The transfer commands, defined once: what an engine asks of its ranks' transfer workers.

The vLLM scheduler side ships them to every worker rank in each step's metadata (plain frozen dataclasses of
ids and block ids: picklable, no tensors); :class:`~pdconnector.worker.transfer_worker.TransferWorker`'s role
methods build the same ones for the commands they queue to the transfer thread.

``request_id`` is the engine's own name for the request (vLLM's request id, by which a worker rank
reports); the transfer worker keys everything by ``transfer_id`` and never reads it, so callers
without one leave it empty.

No command carries a clock reading: the worker's role methods that take a decode command also take
its ``timeout_s`` and measure the deadline on the worker's own monotonic clock from that moment, not
from when the scheduler staged the command in another process. The one duration a command carries,
``ReadBlocks.valid_for_s``, bounds that timeout: how long prefill still holds the blocks to be read.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdconnector.protocol.params import PrefillCoordinates

BlockIds = tuple[tuple[int, ...], ...]  # one tuple of block ids per KV cache group


@dataclass(frozen=True)
class PrefillDone:
    """Prefill: hold ``block_ids`` for decode (push: pair with its registration; pull: wait for its READ)."""

    request_id: str
    transfer_id: str
    block_ids: BlockIds
    num_tokens: int
    pull: bool


@dataclass(frozen=True)
class ExpectPush:
    """Decode, push: register ``block_ids`` with every prefill rank that writes this rank and wait for their
    writes.

    ``cached_blocks`` leading attention blocks of the prompt are already local (prefix cache): ``block_ids``
    and ``num_tokens`` cover only what follows them, and prefill skips as many of its blocks. A higher
    ``attempt`` (after preemption) replaces the pending one."""

    request_id: str
    transfer_id: str
    prefill: PrefillCoordinates
    block_ids: BlockIds
    num_tokens: int
    cached_blocks: int = 0
    attempt: int = 0


@dataclass(frozen=True)
class ReadBlocks:
    """Decode, pull: READ prefill's ``remote_block_ids`` into ``block_ids``; prefill is told when it may
    free."""

    request_id: str
    transfer_id: str
    prefill: PrefillCoordinates
    remote_block_ids: BlockIds
    block_ids: BlockIds
    num_tokens: int
    # prefill's hold outlasts staging by at least this: READs end before it runs out
    valid_for_s: float = float("inf")


@dataclass(frozen=True)
class CancelTransfer:
    """Either side: give up on the transfer, free, tell the peer; decode reports the request as failed."""

    request_id: str
    transfer_id: str
    detail: str


@dataclass(frozen=True)
class AbandonTransfer:
    """Decode: a request that ended before it had blocks to receive into. Nothing of it is registered or read,
    but prefill holds its blocks for it (push: waiting for a registration; pull: for READs): tell prefill at
    once, so it frees now rather than at its lease."""

    request_id: str
    transfer_id: str
    prefill: PrefillCoordinates
    detail: str
