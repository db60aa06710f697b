"""Active health checks eject failing backends and re-admit them once they answer again."""

from __future__ import annotations

import asyncio

import aiohttp
from pdconnector.router.backends import BackendPool, BackendSpec, Role
from pdconnector.router.health import HealthSettings, probe_all


async def test_probe_ejects_after_threshold_and_readmits_on_success(cluster):
    pool = BackendPool()
    engine = cluster.decode[0]
    pool.replace([BackendSpec(name=engine.name, role=Role.DECODE, host=engine.host, http_port=cluster.decode_port, engine_id="d0")])
    backend = pool.all()[0]
    settings = HealthSettings(timeout_s=0.5, failures_to_eject=2)
    async with aiohttp.ClientSession() as session:
        engine.health_status = 503
        await probe_all(session, pool, settings)
        assert backend.healthy and backend.consecutive_failures == 1
        await probe_all(session, pool, settings)
        assert not backend.healthy and "503" in (backend.last_error or "")
        engine.health_status = 200
        await probe_all(session, pool, settings)
        assert backend.healthy and backend.last_error is None


async def test_unreachable_backend_is_ejected_and_ready_reflects_it(cluster, make_router):
    client = await make_router()
    assert (await client.get("/ready")).status == 200
    for engine in cluster.decode:
        await cluster.stop(engine)
    for _ in range(50):
        if (await client.get("/ready")).status == 503:
            break
        await asyncio.sleep(0.05)
    status = await (await client.get("/status")).json()
    assert [b["healthy"] for b in status["backends"] if b["role"] == "decode"] == [False, False]
    assert (await client.get("/ready")).status == 503


async def test_advertised_compat_hash_is_learned_from_health(cluster):
    pool = BackendPool()
    engine = cluster.prefill[0]
    engine.health_body = {"status": "ok", "compat_hash": "old"}
    pool.replace(
        [BackendSpec(name=engine.name, role=Role.PREFILL, host=engine.host, http_port=cluster.prefill_port, engine_id="p0", compat_hash="new")]
    )
    async with aiohttp.ClientSession() as session:
        await probe_all(session, pool, HealthSettings())
    assert pool.all()[0].compat_hash == "old"
