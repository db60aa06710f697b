"""Decode telling prefill it will never take a transfer's KV (the request ended before anything was
registered): look the prefill engine up, then send an abort to every rank that would have written this rank,
so prefill frees its copy now instead of at its lease. Nothing waits on it: a prefill not reached frees at
its lease."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from pdconnector.layout import writers_for
from pdconnector.protocol.messages import MAX_DETAIL_CHARS, AbortMessage
from pdconnector.transport.base import TransportError
from pdconnector.worker.commands import AbandonTransfer
from pdconnector.worker.context import WorkerContext
from pdconnector.worker.identity import EngineInfo
from pdconnector.worker.peers import PeerRegistry
from pdconnector.worker.side_channel import SideChannelClient

log = logging.getLogger(__name__)


@dataclass
class Abandoning:
    """A transfer given up before anything was registered: its abort waits for the prefill engine's agents."""

    command: AbandonTransfer
    deadline: float
    info: Future[EngineInfo]


class Abandons:
    def __init__(
        self,
        context: WorkerContext,
        peers: PeerRegistry,
        side_channel: SideChannelClient | None,
        wake: Callable[[], None],
    ) -> None:
        self._context = context
        self._peers = peers
        self._side_channel = side_channel
        self._wake = wake
        self._abandoning: dict[str, Abandoning] = {}

    def abandon(self, command: AbandonTransfer, deadline: float) -> None:
        """Tell the prefill ranks this rank would have received from that it never will (no result: nothing
        waits)."""
        if self._side_channel is None or command.transfer_id in self._abandoning:
            return
        future = self._side_channel.lookup(command.prefill)
        future.add_done_callback(lambda _: self._wake())
        self._abandoning[command.transfer_id] = Abandoning(command, deadline, future)

    def poll(self, now: float) -> bool:
        progressed = False
        for transfer_id, abandoning in list(self._abandoning.items()):
            command = abandoning.command
            if not abandoning.info.done():
                if abandoning.deadline <= now:
                    # Prefill frees at its lease without us; nothing else is lost.
                    del self._abandoning[transfer_id]
                    log.info(
                        "transfer %s: prefill %s not reached to abandon it; it frees at its lease",
                        transfer_id,
                        command.prefill.engine_id,
                    )
                continue
            del self._abandoning[transfer_id]
            progressed = True
            try:
                engine = abandoning.info.result()
                self._peers.load_engine(engine, host=command.prefill.host)
            except (ConnectionError, OSError, ValueError, TransportError) as error:
                log.info(
                    "transfer %s: cannot reach prefill %s to abandon it (%s); it frees at its lease",
                    transfer_id,
                    command.prefill,
                    error,
                )
                continue
            rank = self._context.layout.tp_rank
            message = AbortMessage(
                transfer_id=transfer_id, attempt=0, decode_rank=rank, detail=command.detail[:MAX_DETAIL_CHARS]
            )
            for p in writers_for(rank, engine.tp_size, self._context.layout.tp_size):
                self._context.send(engine.ranks[p].agent_name, message)
        return progressed
