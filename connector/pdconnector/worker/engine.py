"""One engine's transfer plumbing: a :class:`TransferWorker` per TP rank, one side-channel server, one client.

The server answers with every rank's agent and regions and loads announcing peers into every
rank's worker; the client (shared by the ranks) announces this engine when it looks a peer up.
Ranks start one after the other (a process's first NIXL agent pays the library's start-up; later
ones take milliseconds, and no agent is created concurrently with another) and the server
answers "not ready" until all of them are registered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from pdconnector.layout import BlockPlacement, KVModel, RankLayout
from pdconnector.protocol.params import PrefillCoordinates, mint_incarnation
from pdconnector.transport.base import MemoryRegion, Transport
from pdconnector.worker.identity import EngineInfo, layout_summary
from pdconnector.worker.side_channel import SideChannelClient, SideChannelServer
from pdconnector.worker.transfer_worker import TransferWorker, WorkerConfig


class EngineTransfers:
    """Args:
    regions: per rank, the memory regions of that rank's pools (``RankLayout.regions`` order).
    placement: where every rank's block pages sit in its regions.
    transport_factory: builds rank ``r``'s transport; called on that rank's worker thread.
    config: shared settings; ``engine_id``, ``host`` and ``side_channel_port`` (0 picks a free port) name this
    engine.
    """

    def __init__(
        self,
        model: KVModel,
        *,
        tp_size: int,
        num_blocks: int,
        regions: Sequence[Sequence[MemoryRegion]],
        transport_factory: Callable[[int], Transport],
        config: WorkerConfig,
        side_channel_timeout_s: float = 5.0,
        on_result: Callable[[], None] | None = None,
        placement: BlockPlacement = BlockPlacement.LAYER_OUTER,
    ) -> None:
        if len(regions) != tp_size:
            raise ValueError(f"regions: expected one list per TP rank ({tp_size}), got {len(regions)}")
        self.model = model
        self.tp_size = tp_size
        self.incarnation = mint_incarnation()
        self._info: EngineInfo | None = None
        self.server = SideChannelServer(
            config.host, config.side_channel_port, engine_info=self.info, on_announce=self._on_announce
        )
        self.config = replace(config, side_channel_port=self.server.port)
        self.client = SideChannelClient(announce=self.info, timeout_s=side_channel_timeout_s)
        self.workers = [
            TransferWorker(
                RankLayout(model, tp_size, rank, num_blocks, placement),
                regions[rank],
                lambda rank=rank: transport_factory(rank),
                config=self.config,
                side_channel=self.client,
                on_result=on_result,
            )
            for rank in range(tp_size)
        ]

    @property
    def engine_id(self) -> str:
        return self.config.engine_id

    @property
    def coordinates(self) -> PrefillCoordinates:
        """What the router hands to decode engines to reach this one."""
        return PrefillCoordinates(
            self.engine_id, self.config.host, self.server.port, self.tp_size, self.incarnation
        )

    def start(self) -> EngineInfo:
        ranks = tuple(worker.start() for worker in self.workers)
        self._info = EngineInfo(
            self.engine_id, self.tp_size, layout_summary(self.model), ranks, incarnation=self.incarnation
        )
        return self._info

    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError(f"engine {self.engine_id}: transfer workers not started yet")
        return self._info

    def close(self) -> None:
        self.server.close()
        self.client.close()
        for worker in self.workers:
            worker.close()

    def __enter__(self) -> EngineTransfers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _on_announce(self, peer: EngineInfo) -> None:
        for worker in self.workers:
            worker.add_peers(peer)
