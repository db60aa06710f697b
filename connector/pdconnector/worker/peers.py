"""The peer agents one rank's transport has loaded: which metadata is in, which engine each agent belongs to.

Agents arrive three ways, all on the worker thread: a whole engine from a side-channel answer
(decode looking prefill up) or announce (prefill learning of decode), and a single agent from a
registration's metadata (which names its engine and rank). Metadata already loaded is not loaded
again. An agent is kept per (engine id, rank): when one comes back under another agent name (the
engine restarted: agent names carry the process incarnation), the earlier incarnation's agent is
removed, so the transport keeps no connections to processes that are gone and the number of agents
(``len``) stays that of the live peer ranks. An agent's doorbell goes with it.
"""

from __future__ import annotations

import logging

from pdconnector.transport.base import TransportError
from pdconnector.worker.context import WorkerContext
from pdconnector.worker.identity import EngineInfo

log = logging.getLogger(__name__)


class PeerRegistry:
    def __init__(self, context: WorkerContext) -> None:
        self._context = context
        self._metadata: dict[str, bytes] = {}  # agent name -> metadata loaded into the transport
        self._rank_agents: dict[tuple[str, int], str] = {}  # (engine id, rank) -> that rank's current agent

    def __contains__(self, agent: object) -> bool:
        """Whether the transport can reach ``agent`` (its metadata is loaded)."""
        return agent in self._metadata

    def __len__(self) -> int:
        return len(self._metadata)

    def load_engine(self, engine: EngineInfo, *, host: str | None = None) -> None:
        """Load an engine's agents; drop the agents an earlier incarnation of the same engine id had. A rank's
        doorbell is on its own node (``RankInfo.host``), else on ``host``: the engine's side-channel host, for
        a peer that does not say (None: not known here)."""
        for rank in engine.ranks:
            name = self.load(rank.agent_metadata, engine_id=engine.engine_id, tp_rank=rank.tp_rank)
            doorbell_host = rank.host or host
            if doorbell_host is not None:
                self._context.set_doorbell(name, doorbell_host, rank.doorbell_port)

    def load(self, metadata: bytes, *, engine_id: str, tp_rank: int) -> str:
        """Load the agent of ``engine_id``'s rank ``tp_rank`` unless it is in already (replacing an earlier
        incarnation's); returns the agent's name."""
        name = next((agent for agent, loaded in self._metadata.items() if loaded == metadata), None)
        if name is None:
            name = self._context.transport.add_peer(metadata)
            self._metadata[name] = metadata
            self._context.count("peers_loaded")
        previous = self._rank_agents.get((engine_id, tp_rank))
        if previous is not None and previous != name:
            self._forget(previous)
            self._context.count("peers_dropped")
        self._rank_agents[(engine_id, tp_rank)] = name
        return name

    def _forget(self, name: str) -> None:
        self._metadata.pop(name, None)
        self._context.forget_doorbell(name)
        try:
            self._context.transport.remove_peer(name)
        except TransportError as error:
            log.info("removing stale peer %s: %s", name, error)
