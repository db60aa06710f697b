"""Mock engines served in the test process (aiohttp test servers), for the transfer tests on host and GPU
pools."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pdconnector.protocol.params import EngineRole
from pdconnector.sim.engine import EngineSettings, MockEngine
from pdconnector.sim.metrics import EngineMetrics
from pdconnector.sim.movers import create_mover
from pdconnector.sim.pool import KVDevice, KVPool
from pdconnector.sim.scheduler import LatencyModel
from pdconnector.sim.server import create_engine_app
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny"
PROMPT = list(range(100, 150))

Serve = Callable[..., Awaitable[tuple[TestClient, MockEngine]]]


def serving(app: web.Application) -> TestServer:
    """A test server for an engine app, run as pd-mock-engine runs it: a client that disconnects cancels its
    request."""
    return TestServer(app, handler_cancellation=True)


async def metrics(client: TestClient) -> dict[str, float]:
    """The engine's ``/metrics`` samples by name, labels folded into the name as ``name{k=v,...}``."""
    samples = {}
    for family in text_string_to_metric_families(await (await client.get("/metrics")).text()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


async def eventually(condition: Callable[[], bool], within_s: float) -> bool:
    """Whether ``condition`` holds at some poll within ``within_s`` seconds."""
    deadline = asyncio.get_running_loop().time() + within_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@contextlib.asynccontextmanager
async def engine_servers(transport: str, device: KVDevice = KVDevice.CPU) -> AsyncIterator[Serve]:
    """``serve(role, name, transfer_timeout_s=5, lease_s=5, prefill_s=0, decode_s=0)`` starts an engine of 64
    blocks of 16 tokens on ``device`` moving KV over ``transport`` (``*_s``: seconds per token); every engine
    started is stopped on exit."""
    clients: list[TestClient] = []

    async def serve(
        role: EngineRole | None,
        name: str,
        *,
        transfer_timeout_s: float = 5.0,
        lease_s: float = 5.0,
        prefill_s: float = 0.0,
        decode_s: float = 0.0,
    ) -> tuple[TestClient, MockEngine]:
        pool = KVPool(64, 16, device=device)
        mover = create_mover(
            transport, pool=pool, engine_id=name, host="127.0.0.1", side_channel_port=0, lease_s=lease_s
        )
        latency = LatencyModel(prefill_s_per_token=prefill_s, decode_s_per_token=decode_s)
        settings = EngineSettings(
            role=role, engine_id=name, latency=latency, transfer_timeout_s=transfer_timeout_s
        )
        engine = MockEngine(settings, pool, mover, EngineMetrics(pool))
        client = TestClient(serving(create_engine_app(engine, MODEL)))
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
