"""The peer agents one rank's transport has loaded: which metadata is in, which engine each agent belongs to.

Agents arrive three ways, all on the worker thread: a whole engine from a side-channel answer
(decode looking prefill up) or announce (prefill learning of decode), and a single agent from a
registration's metadata. Metadata already loaded is not loaded again. When an engine id comes back
with other agents (the engine restarted), the agents of its earlier incarnation are removed, so
the transport does not keep connections to processes that are gone.
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
        self._engine_agents: dict[str, tuple[str, ...]] = {}  # engine id -> its agents we loaded

    def __contains__(self, agent: object) -> bool:
        """Whether the transport can reach ``agent`` (its metadata is loaded)."""
        return agent in self._metadata

    def load_engine(self, engine: EngineInfo) -> None:
        """Load an engine's agents; drop the agents an earlier incarnation of the same engine id had."""
        names = tuple(self.load(rank.agent_metadata) for rank in engine.ranks)
        stale = set(self._engine_agents.get(engine.engine_id, ())) - set(names)
        for name in stale:
            self._forget(name)
            self._context.count("peers_dropped")
        self._engine_agents[engine.engine_id] = names

    def load(self, metadata: bytes) -> str:
        """Load one agent's metadata unless it is in already; returns the agent's name."""
        name = self._context.transport.add_peer(metadata) if metadata not in self._metadata.values() else None
        if name is None:
            return next(agent for agent, loaded in self._metadata.items() if loaded == metadata)
        self._metadata[name] = metadata
        return name

    def _forget(self, name: str) -> None:
        self._metadata.pop(name, None)
        try:
            self._context.transport.remove_peer(name)
        except TransportError as error:
            log.info("removing stale peer %s: %s", name, error)
