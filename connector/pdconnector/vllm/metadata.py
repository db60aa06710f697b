"""What the scheduler side ships to every worker rank once per engine step (picklable, no tensors).

Each command names the vLLM request id (what the engine tracks) and the transfer id (what the
peers agree on); a worker rank reports results by request id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from pdconnector.protocol.params import PrefillCoordinates

BlockIds = tuple[tuple[int, ...], ...]


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
    """Decode, push: register ``block_ids`` with prefill and wait for its writes.

    ``cached_blocks`` leading attention blocks of the prompt are already local (prefix cache): ``block_ids``
    and ``num_tokens`` cover only what follows them, and prefill skips as many of its blocks."""

    request_id: str
    transfer_id: str
    prefill: PrefillCoordinates
    block_ids: BlockIds
    num_tokens: int
    cached_blocks: int = 0


@dataclass(frozen=True)
class ReadBlocks:
    """Decode, pull: READ prefill's ``remote_block_ids`` into ``block_ids``."""

    request_id: str
    transfer_id: str
    prefill: PrefillCoordinates
    remote_block_ids: BlockIds
    block_ids: BlockIds
    num_tokens: int


@dataclass(frozen=True)
class CancelTransfer:
    """Either side: give up on the transfer, free, tell the peer; decode reports the request as failed."""

    request_id: str
    transfer_id: str
    detail: str


@dataclass(frozen=True)
class FailRequest:
    """Decode: the request cannot receive at all (bad parameters); report it failed without touching the network."""

    request_id: str
    detail: str


Command = PrefillDone | ExpectPush | ReadBlocks | CancelTransfer | FailRequest


@dataclass
class PDConnectorMetadata(KVConnectorMetadata):
    """One step's commands; ``engine`` (this engine as its side channel serves it, msgpack) and ``peers``
    (engines that announced themselves, msgpack) let ranks in other processes share the handshake."""

    commands: list[Command] = field(default_factory=list)
    engine: bytes | None = None
    peers: list[bytes] = field(default_factory=list)


@dataclass
class RankHandshake(KVConnectorHandshakeMetadata):
    """One worker rank's :class:`~pdconnector.worker.identity.RankInfo` (msgpack) and the KV layout it registered
    (:func:`~pdconnector.worker.identity.layout_summary`), gathered by vLLM into the scheduler side."""

    rank_info: bytes
    layout: dict[str, str]
