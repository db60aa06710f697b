"""Engines larger than a node, as vLLM runs them: each node's ranks in their own process, one side channel.

A multi-node vLLM engine starts a worker process per rank on every node; their handshakes are gathered into
the engine core on the first node (``set_xfer_handshake_metadata``), whose side channel alone serves every
rank's agent, device and host. Here one engine process per node (:class:`~tests.pdconnector.worker.engines.
EngineHost`, ranks as threads) stands in for a node and binds its own loopback address (127.0.0.1,
127.0.0.2, ...: Linux delivers all of 127/8 locally), so a peer that reached a rank at the wrong node's
address would miss it.

:class:`EngineNode` is one node's part of the engine (transfer workers and a side-channel client, the
server only on the first node); :class:`SpanningEngine` drives the nodes from the test process as one
engine, with the methods of one :class:`~tests.pdconnector.worker.engines.RemoteEngine`, so the transfer
scenarios run unchanged. Engines that announce themselves are loaded into the first node's ranks only: the
other nodes' ranks learn a decode engine's agents from its registrations, which carry them, as they do in
vLLM when a registration overtakes the announce the scheduler forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdconnector.layout import BlockPlacement, KVModel, RankLayout
from pdconnector.protocol.params import PrefillCoordinates, mint_incarnation
from pdconnector.transport.base import MemoryRegion, Transport
from pdconnector.worker import WorkerConfig
from pdconnector.worker.identity import EngineInfo, RankInfo
from pdconnector.worker.side_channel import SideChannelClient, SideChannelServer
from pdconnector.worker.transfer_worker import TransferWorker

from tests.ports import free_port

NODE_HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4")


def spanning_engine(
    processes: Sequence[Any], name: str, model: str | dict[str, Any], *, tp: int, **options: Any
) -> SpanningEngine:
    """An engine of ``tp`` ranks over one engine process per node (``processes``, each an
    :class:`~tests.pdconnector.worker.engines.EngineHost`), the ranks split evenly in order: node ``n`` binds
    ``NODE_HOSTS[n]``; ``options``: the :class:`~tests.pdconnector.worker.engines.Engine` keyword arguments of
    every node."""
    nodes = len(processes)
    if tp % nodes:
        raise ValueError(f"{tp} ranks do not split evenly over {nodes} nodes")
    per_node, port = tp // nodes, free_port()
    return SpanningEngine(
        [
            process.create(
                name,
                model,
                tp=tp,
                ranks=list(range(node * per_node, (node + 1) * per_node)),
                host=NODE_HOSTS[node],
                side_channel_port=port,
                **options,
            )
            for node, process in enumerate(processes)
        ]
    )


def one_side_spanning(
    single: Any,
    nodes: Sequence[Any],
    tag: str,
    model: str | dict[str, Any],
    *,
    tps: tuple[int, int],
    blocks: tuple[int, int],
    spanning: str,
    **options: Any,
) -> tuple[Any, Any]:
    """A prefill and a decode engine (TP ``tps``, pools of ``blocks``), the ``spanning`` one (``"prefill"`` or
    ``"decode"``) over one process per node (``nodes``), the other in the ``single`` process."""
    if spanning not in ("prefill", "decode"):
        raise ValueError(f"spanning: expected 'prefill' or 'decode', got {spanning!r}")
    engines = []
    for role, tp, num_blocks in (("prefill", tps[0], blocks[0]), ("decode", tps[1], blocks[1])):
        name = f"{role}-{tag}"
        engines.append(
            spanning_engine(nodes, name, model, tp=tp, num_blocks=num_blocks, **options)
            if role == spanning
            else single.create(name, model, tp=tp, num_blocks=num_blocks, **options)
        )
    return engines[0], engines[1]


class EngineNode:
    """Ranks ``ranks`` of a ``tp_size`` engine, on the node at ``config.host``; ``regions``: per hosted rank,
    its pools' regions."""

    def __init__(
        self,
        model: KVModel,
        *,
        tp_size: int,
        ranks: Sequence[int],
        num_blocks: int,
        regions: Sequence[Sequence[MemoryRegion]],
        transport_factory: Callable[[int], Transport],
        config: WorkerConfig,
        on_result: Callable[[], None],
        placement: BlockPlacement,
    ) -> None:
        self.config = config
        self.server: SideChannelServer | None = None
        self._info: EngineInfo | None = None
        self.client = SideChannelClient(announce=self.info)
        self.workers = [
            TransferWorker(
                RankLayout(model, tp_size, rank, num_blocks, placement),
                rank_regions,
                lambda rank=rank: transport_factory(rank),
                config=config,
                side_channel=self.client,
                on_result=on_result,
            )
            for rank, rank_regions in zip(ranks, regions, strict=True)
        ]

    def start(self) -> list[RankInfo]:
        return [worker.start() for worker in self.workers]

    def join(self, info: EngineInfo, *, serve: bool) -> PrefillCoordinates | None:
        """The engine as the first node assembled it (what vLLM's scheduler ships to every rank); ``serve``:
        this is the first node, which runs the side channel. Returns the engine's coordinates there."""
        self._info = info
        if not serve:
            return None
        self.server = SideChannelServer(
            self.config.host,
            self.config.side_channel_port,
            engine_info=self.info,
            on_announce=self._on_announce,
        )
        return PrefillCoordinates(
            info.engine_id, self.config.host, self.server.port, info.tp_size, info.incarnation
        )

    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError(f"engine {self.config.engine_id}: not every node has started yet")
        return self._info

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.client.close()
        for worker in self.workers:
            worker.close()

    def _on_announce(self, peer: EngineInfo) -> None:
        for worker in self.workers:
            worker.add_peers(peer)


class SpanningEngine:
    """One engine over several node processes (``nodes``, first node first), driven as one engine: calls go
    to every node, results come back together, ranks numbered engine-wide."""

    def __init__(self, nodes: Sequence[Any]) -> None:
        self.nodes = list(nodes)

    def start(self) -> dict[str, Any]:
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            ranks = [
                rank for node_ranks in pool.map(lambda node: node.start(), self.nodes) for rank in node_ranks
            ]
        incarnation = mint_incarnation()  # the first node's engine core would mint it and tell the others
        coordinates = [
            node.join(ranks=ranks, serve=index == 0, incarnation=incarnation)
            for index, node in enumerate(self.nodes)
        ]
        return coordinates[0]

    def check(self, **kwargs: Any) -> dict[str, int]:
        counts = [node.check(**kwargs) for node in self.nodes]
        return {key: sum(count[key] for count in counts) for key in counts[0]}

    def wait(self, transfer_id: str, timeout_s: float) -> list[dict[str, Any]]:
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            waits = pool.map(lambda node: node.wait(transfer_id=transfer_id, timeout_s=timeout_s), self.nodes)
            return [result for node_results in waits for result in node_results]

    def wait_stat(self, name: str, value: int, timeout_s: float) -> bool:
        return all(node.wait_stat(name=name, value=value, timeout_s=timeout_s) for node in self.nodes)

    def __getattr__(self, method: str) -> Callable[..., list[Any]]:
        """Any other call: made on every node; per-rank answers (``stats``, ``differences``) concatenated."""
        if method.startswith("_"):
            raise AttributeError(method)

        def on_every_node(**kwargs: Any) -> list[Any]:
            answers = [getattr(node, method)(**kwargs) for node in self.nodes]
            return [item for answer in answers if answer is not None for item in answer]

        return on_every_node
