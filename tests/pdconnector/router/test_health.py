"""Active health checks eject failing backends and re-admit them once they answer again; one stuck backend
never takes the service down."""

from __future__ import annotations

import asyncio
import math

import aiohttp
from pdconnector.protocol.params import EngineRole
from pdconnector.router.app import RouterOptions
from pdconnector.router.backends import BackendPool, BackendSpec
from pdconnector.router.health import HealthSettings, probe_all


async def test_probe_ejects_after_threshold_and_readmits_on_success(cluster):
    pool = BackendPool()
    engine = cluster.decode[0]
    pool.replace(
        [
            BackendSpec(
                name=engine.name,
                role=EngineRole.DECODE,
                host=engine.host,
                http_port=cluster.decode_port,
                engine_id="d0",
            )
        ]
    )
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
        [
            BackendSpec(
                name=engine.name,
                role=EngineRole.PREFILL,
                host=engine.host,
                http_port=cluster.prefill_port,
                engine_id="p0",
                compat_hash="new",
            )
        ]
    )
    async with aiohttp.ClientSession() as session:
        await probe_all(session, pool, HealthSettings())
    assert pool.all()[0].compat_hash == "old"


async def test_one_unanswered_health_check_does_not_eject_a_busy_backend(cluster):
    pool = BackendPool()
    engine = cluster.decode[0]
    pool.replace(
        [
            BackendSpec(
                name=engine.name,
                role=EngineRole.DECODE,
                host=engine.host,
                http_port=cluster.decode_port,
                engine_id="d0",
            )
        ]
    )
    backend = pool.all()[0]
    settings = HealthSettings(timeout_s=0.2, failures_to_eject=2)
    engine.health_stalls = 1
    async with aiohttp.ClientSession() as session:
        await probe_all(session, pool, settings)
        assert backend.healthy and backend.last_error == "/health gave no answer in 0.2 s"
        await probe_all(session, pool, settings)
    assert backend.healthy and backend.consecutive_failures == 0


WEDGE_WATCH = RouterOptions(
    health=HealthSettings(interval_s=0.05, timeout_s=0.2, failures_to_eject=2), refresh_interval_s=0.05
)


async def backend_states(client) -> dict[str, bool]:
    return {b["name"]: b["healthy"] for b in (await (await client.get("/status")).json())["backends"]}


async def until_state(client, name: str, healthy: bool) -> None:
    for _ in range(60):
        if (await backend_states(client))[name] is healthy:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} never became {'healthy' if healthy else 'ejected'}")


async def test_a_decode_that_stops_answering_is_left_out_while_the_other_serves_every_request(
    cluster, make_router
):
    wedged, other = cluster.decode
    wedged.health_stalls = math.inf
    wedged.behaviour = "hang"
    # round-robin would alternate onto the wedged one
    client = await make_router(options=WEDGE_WATCH, policy="round-robin")
    await until_state(client, wedged.name, healthy=False)
    for _ in range(6):
        response = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}
        )
        assert response.status == 200 and response.headers["x-pd-decode"] == other.name
    assert not wedged.bodies
    assert (await client.get("/ready")).status == 200


async def test_a_lone_decode_that_stops_answering_is_a_503_saying_why_until_it_answers_again(
    cluster, make_router
):
    decode = cluster.decode[0]
    client = await make_router(options=WEDGE_WATCH, decode_engines=[decode])
    decode.health_stalls = math.inf
    await until_state(client, decode.name, healthy=False)
    response = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert response.status == 503 and response.headers["Retry-After"] == "1"
    error = (await response.json())["error"]
    assert error["code"] == "no_decode_backend"
    assert error["message"] == (
        "No healthy decode backend is available: d0: ejected (2 failure(s) in a row, last: /health gave no "
        "answer in 0.2 s)"
    )
    decode.health_stalls = 0  # no longer busy: the next check it passes re-admits it
    await until_state(client, decode.name, healthy=True)
    assert (await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})).status == 200
