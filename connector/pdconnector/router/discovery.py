"""Backends from the router config file: pod DNS names resolved to pod addresses, and live reload on change.

The config lists each engine pod by its stable DNS name (``<pod>.<headless service>.<namespace>.svc``).
Prefill coordinates must carry the pod IP (the side channel binds to it), so names are resolved on every
refresh; a name that does not resolve (pod not ready, not in a cluster) keeps its last known address and
health checks decide.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from pathlib import Path

from pdconnector.protocol.params import EngineRole
from pdconnector.router.backends import BackendSpec
from pdconnector.router.config import RoleBackends, RouterConfig, load_router_config

log = logging.getLogger(__name__)


async def resolve_address(host: str) -> str | None:
    """First address of a DNS name, or None when it does not resolve (yet)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):
        return None
    return str(infos[0][4][0]) if infos else None


def _role_specs(
    role: EngineRole, backends: RoleBackends, compat_hash: str, addresses: dict[str, str]
) -> list[BackendSpec]:
    return [
        BackendSpec(
            name=entry.name,
            role=role,
            host=addresses.get(entry.host, entry.host),
            http_port=backends.http_port,
            engine_id=entry.engine_id,
            compat_hash=compat_hash,
            side_channel_port=backends.side_channel_port if role is EngineRole.PREFILL else None,
            tp_size=backends.tp_size,
            draining=entry.draining,
            kv_events_port=backends.kv_events_port,
            kv_events_address=entry.kv_events_endpoint,
        )
        for entry in backends.backends
    ]


def backend_specs(config: RouterConfig, addresses: dict[str, str]) -> list[BackendSpec]:
    """All backends of a config, with each pod DNS name replaced by its resolved address when known."""
    return _role_specs(EngineRole.PREFILL, config.prefill, config.compat_hash, addresses) + _role_specs(
        EngineRole.DECODE, config.decode, config.compat_hash, addresses
    )


class AddressBook:
    """Pod DNS name -> last resolved address; failures keep the previous answer."""

    def __init__(self) -> None:
        self.addresses: dict[str, str] = {}

    async def refresh(self, config: RouterConfig) -> None:
        hosts = [entry.host for role in (config.prefill, config.decode) for entry in role.backends]
        resolved = await asyncio.gather(*(resolve_address(host) for host in hosts))
        for host, address in zip(hosts, resolved, strict=True):
            if address is not None:
                self.addresses[host] = address
            elif host not in self.addresses:
                log.warning("pod name does not resolve yet", extra={"host": host})


class ConfigWatcher:
    """Reloads the config file when its mtime changes (a ConfigMap update swaps the file under the pod)."""

    def __init__(self, path: Path, on_change: Callable[[RouterConfig], None]) -> None:
        self.path = path
        self.on_change = on_change
        self._stamp: tuple[float, int] | None = None

    def _current_stamp(self) -> tuple[float, int] | None:
        try:
            stat = self.path.stat()
        except OSError:
            return None
        return (stat.st_mtime, stat.st_size)

    def check(self) -> bool:
        """Reload if the file changed; a broken file is logged and the previous config stays in force."""
        stamp = self._current_stamp()
        if stamp is None or stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            config = load_router_config(self.path)
        except (ValueError, OSError) as error:
            log.error(
                "router config reload failed; keeping the previous config",
                extra={"path": str(self.path), "error": str(error)},
            )
            return False
        self.on_change(config)
        return True
