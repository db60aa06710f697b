"""What the scheduler side ships to every worker rank once per engine step (picklable, no tensors).

The transfer commands are the transfer worker's own (:mod:`pdconnector.worker.commands`): each names
the vLLM request id (what the engine tracks) and the transfer id (what the peers agree on); a worker
rank reports results by request id. :class:`FailRequest` and :class:`ReleaseBlocks` are vLLM's alone; the
tier's commands (:class:`LoadFromTier`, :class:`SaveToTier`) run on the engine's thread, in the order staged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from pdconnector.worker.commands import AbandonTransfer, CancelTransfer, ExpectPush, PrefillDone, ReadBlocks


@dataclass(frozen=True)
class FailRequest:
    """Decode: the request cannot receive at all (bad parameters); report it failed without touching the
    network."""

    request_id: str
    detail: str


@dataclass(frozen=True)
class ReleaseBlocks:
    """Decode: the request failed while a prefill could still write into its blocks, and vLLM ended it; each
    rank reports it in ``finished_sending`` once no peer can write into its share of the blocks any more (at
    once where none could), and vLLM frees them when every rank has."""

    request_id: str


@dataclass(frozen=True)
class LoadFromTier:
    """Copy the request's leading blocks its tier holds (``slots`` into ``block_ids``, attention blocks).

    Decode: before its transfer starts; then hand ``then`` to the transfer worker: the transfer of the blocks
    after them, or, when the tier held every block to fill, prefill's release of its copy (the request has
    its KV then). If the copy fails on this rank, ``otherwise`` instead: the transfer of every block.
    Prefill (``then`` and ``otherwise`` None): before this step's forward computes the rest of the prompt (a
    synchronous load, vLLM's ``load_kv_async=False``); if the copy fails on this rank, its blocks are reported
    as load errors and vLLM recomputes them or fails the request (its ``kv_load_failure_policy``).

    The copy runs when the rank takes the command, before any later command: a slot a later save reuses is
    read first, so the scheduler need not keep it pinned."""

    request_id: str
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]
    then: ExpectPush | ReadBlocks | AbandonTransfer | None = None
    otherwise: ExpectPush | ReadBlocks | None = None


@dataclass(frozen=True)
class SaveToTier:
    """A finished request's blocks ``block_ids`` (attention blocks) into ``slots``; each rank reports the
    request in ``finished_sending`` once copied, and vLLM frees the blocks when every rank has.
    ``after_send`` (prefill): the blocks are held for decode's transfer, so the copy waits until that
    transfer ended (it never delays the KV decode waits for) and is reported with it."""

    request_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    after_send: bool = False


@dataclass
class TierFailures(KVConnectorWorkerMetadata):
    """Worker ranks -> scheduler side: the requests whose tier copies failed on some rank this step.
    ``saves``: reported no later than the ``finished_sending`` that ends the save, so the scheduler frees
    their slots instead of making them readable. ``loads``: the blocks came from elsewhere instead (decode:
    prefill, the whole transfer; prefill: its forward), which the scheduler counts as their source."""

    saves: set[str] = field(default_factory=set)
    loads: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TierFailures)
        return TierFailures(self.saves | other.saves, self.loads | other.loads)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


Command = (
    PrefillDone
    | ExpectPush
    | ReadBlocks
    | CancelTransfer
    | AbandonTransfer
    | FailRequest
    | ReleaseBlocks
    | LoadFromTier
    | SaveToTier
)


@dataclass
class PDConnectorMetadata(KVConnectorMetadata):
    """One step's commands; ``engine`` (this engine as its side channel serves it, msgpack) and ``peers``
    (engines that announced themselves, msgpack) let ranks in other processes share the handshake.
    ``idle_wait_s``: the step runs no request, so a rank may wait this long for a transfer to end before it
    returns (0: return at once)."""

    commands: list[Command] = field(default_factory=list)
    engine: bytes | None = None
    peers: list[bytes] = field(default_factory=list)
    idle_wait_s: float = 0.0


@dataclass
class RankHandshake(KVConnectorHandshakeMetadata):
    """One worker rank's :class:`~pdconnector.worker.identity.RankInfo` (msgpack) and the KV layout it
    registered (:func:`~pdconnector.worker.identity.layout_summary`), gathered by vLLM into the scheduler
    side."""

    rank_info: bytes
    layout: dict[str, str]
