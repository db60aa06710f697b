"""Mock engines served in the test process (aiohttp test servers), for the transfer tests on host and GPU pools."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp.test_utils import TestClient, TestServer
from pdconnector.sim.engine import EngineSettings, MockEngine, Role
from pdconnector.sim.metrics import EngineMetrics
from pdconnector.sim.mover import create_mover
from pdconnector.sim.pool import KVDevice, KVPool
from pdconnector.sim.server import create_engine_app

MODEL = "tiny"
PROMPT = list(range(100, 150))

Serve = Callable[..., Awaitable[tuple[TestClient, MockEngine]]]


@contextlib.asynccontextmanager
async def engine_servers(transport: str, device: KVDevice = KVDevice.CPU) -> AsyncIterator[Serve]:
    """``serve(role, name, transfer_timeout_s=5, lease_s=5)`` starts an engine of 64 blocks of 16 tokens on ``device``
    moving KV over ``transport``; every engine started is stopped on exit."""
    clients: list[TestClient] = []

    async def serve(role: Role, name: str, transfer_timeout_s: float = 5.0, lease_s: float = 5.0) -> tuple[TestClient, MockEngine]:
        pool = KVPool(64, 16, device=device)
        mover = create_mover(transport, pool=pool, engine_id=name, host="127.0.0.1", side_channel_port=0, lease_s=lease_s)
        engine = MockEngine(EngineSettings(role=role, engine_id=name, transfer_timeout_s=transfer_timeout_s), pool, mover, EngineMetrics(pool))
        client = TestClient(TestServer(create_engine_app(engine, MODEL)))
        await client.start_server()
        clients.append(client)
        return client, engine

    try:
        yield serve
    finally:
        for client in clients:
            await client.close()


def leg(params: dict, max_tokens: int = 5) -> dict:
    """A completion request for ``PROMPT`` carrying ``kv_transfer_params``."""
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "kv_transfer_params": params}
