"""The router's view of its engines: what each backend is, and its live state (health, outstanding
requests)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdconnector.protocol.params import EngineRole, PrefillCoordinates
from pdconnector.router.prefix import PrefixIndex


@dataclass(frozen=True)
class BackendSpec:
    """One engine instance as configured or discovered: stable name plus where to reach it."""

    name: str
    role: EngineRole
    host: str
    http_port: int
    engine_id: str
    compat_hash: str | None = None
    side_channel_port: int | None = None
    tp_size: int = 1
    draining: bool = False  # out of the pool: no new request, those it holds finish
    kv_events_port: int | None = None  # where it publishes vLLM's KV cache events, if it does
    kv_events_address: str | None = None  # a full endpoint instead (local runs)

    @property
    def kv_events_endpoint(self) -> str | None:
        if self.kv_events_address is not None:
            return self.kv_events_address
        if self.kv_events_port is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.kv_events_port}"

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.http_port}"

    def prefill_coordinates(self) -> PrefillCoordinates:
        if self.role is not EngineRole.PREFILL or self.side_channel_port is None:
            raise ValueError(f"backend {self.name} is not a prefill engine with a side-channel port")
        return PrefillCoordinates(
            engine_id=self.engine_id,
            host=self.host,
            side_channel_port=self.side_channel_port,
            tp_size=self.tp_size,
        )


@dataclass
class Backend:
    """A backend's spec and the router's live knowledge of it."""

    spec: BackendSpec
    healthy: bool = True
    outstanding: int = 0
    consecutive_failures: int = 0
    last_error: str | None = None
    served: int = 0
    # prefill only: requests whose KV this engine holds for a decode leg that has not started yet
    kv_held: int = 0
    advertised_compat: str | None = None  # what the engine itself reports on /health, when it does
    # cache-aware policy only
    prefix_index: PrefixIndex | None = None  # what prompt blocks it holds (from its events, or routed there)
    tier_index: PrefixIndex | None = None  # what its KV tier in host memory holds (its events, medium CPU)
    queued_prompt_tokens: int = 0  # uncached prompt tokens of the prefill legs chosen here, not yet done
    kv_usage: float | None = None  # decode: KV cache usage 0..1, from its metrics
    engine_sequences: int | None = None  # decode: running + waiting sequences, from its metrics
    # Set when the health checks eject the engine: every leg in flight on it ends then. A re-admitted engine
    # gets a fresh one, so legs sent to it afterwards are not ended by the old ejection.
    ejected: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def eject(self, error: str) -> None:
        self.healthy = False
        self.last_error = error
        self.ejected.set()
        self.forget_cache()  # it may come back as a new process with an empty cache

    def readmit(self) -> None:
        self.healthy = True
        self.ejected = asyncio.Event()

    def forget_cache(self) -> None:
        """The engine restarted or was ejected: what the router knew of its cache no longer holds."""
        for index in (self.prefix_index, self.tier_index):
            if index is not None:
                index.clear()
        self.kv_usage = None
        self.engine_sequences = None

    @property
    def compat_hash(self) -> str | None:
        return self.advertised_compat or self.spec.compat_hash

    @property
    def name(self) -> str:
        return self.spec.name

    def describe(self) -> str:
        """How errors name an engine: pod name, engine id and address, enough to find its logs."""
        return f"{self.name} (engine id {self.spec.engine_id}, {self.spec.base_url})"

    def compatible_with(self, other: Backend) -> bool:
        """Pair only engines whose compatibility hashes agree, when both advertise one."""
        mine, theirs = self.compat_hash, other.compat_hash
        return mine is None or theirs is None or mine == theirs

    def status(self) -> dict[str, object]:
        return {
            "name": self.name,
            "role": self.spec.role.value,
            "url": self.spec.base_url,
            "engine_id": self.spec.engine_id,
            "compat_hash": self.compat_hash,
            "healthy": self.healthy,
            "draining": self.spec.draining,
            "outstanding": self.outstanding,
            "kv_held": self.kv_held,
            "served": self.served,
            "last_error": self.last_error,
            "prefix_blocks": None if self.prefix_index is None else len(self.prefix_index),
            "tier_blocks": None if self.tier_index is None else len(self.tier_index),
        }


class BackendPool:
    """All backends by role; replacing the spec set keeps the live state of backends that stay."""

    def __init__(self) -> None:
        self._backends: dict[str, Backend] = {}

    def replace(self, specs: Iterable[BackendSpec]) -> None:
        fresh: dict[str, Backend] = {}
        for spec in specs:
            key = f"{spec.role.value}/{spec.name}"
            known = self._backends.get(key)
            if known is not None:
                # The same instance (maybe a new address, coordinates or draining state): requests in flight
                # hold this object, so it stays, counters and all; health is re-checked on the next probe.
                known.spec = spec
                fresh[key] = known
            else:
                fresh[key] = Backend(spec=spec)
        self._backends = fresh

    def all(self) -> list[Backend]:
        return list(self._backends.values())

    def by_role(self, role: EngineRole) -> list[Backend]:
        return [b for b in self._backends.values() if b.spec.role is role]

    def healthy(self, role: EngineRole) -> list[Backend]:
        return [b for b in self.by_role(role) if b.healthy]

    def serving(self, role: EngineRole) -> list[Backend]:
        """Healthy backends that take new requests (not draining)."""
        return [b for b in self.healthy(role) if not b.spec.draining]

    def is_ready(self) -> bool:
        return bool(self.serving(EngineRole.PREFILL)) and bool(self.serving(EngineRole.DECODE))
