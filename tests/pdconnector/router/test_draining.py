"""Scale-down through the router: a draining engine takes no new request, finishes the ones it holds, and the
router says so (``/status``, ``/metrics``) so the operator knows when it may go."""

from __future__ import annotations

import asyncio

from pdconnector.router.app import ROUTER_KEY

from tests.pdconnector.router.test_proxy import COMPLETION, status_of, until


def drained(config, name: str):
    """``config`` with engine ``name`` marked draining."""

    def role(backends):
        entries = [b.model_copy(update={"draining": b.name == name}) for b in backends.backends]
        return backends.model_copy(update={"backends": entries})

    return config.model_copy(update={"prefill": role(config.prefill), "decode": role(config.decode)})


async def test_a_draining_decode_finishes_its_request_and_takes_no_new_one(cluster, make_router):
    client = await make_router(mode="push")
    router = client.server.app[ROUTER_KEY]
    d0, d1 = cluster.decode
    d1.behaviour = "hang"
    # least-outstanding with ties broken by name: the first request goes to d0, hold it there
    d0.behaviour = "hang"
    first = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
    await until(lambda: d0.bodies)
    second = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
    await until(lambda: d1.bodies)

    router.apply_config(drained(router.config, d1.name))
    d0.behaviour = "ok"
    d0.release.set()
    assert (await first).status == 200
    for _ in range(4):  # every new request avoids the draining engine, although it is the idlest
        response = await client.post("/v1/completions", json=COMPLETION)
        assert response.status == 200 and response.headers["x-pd-decode"] == d0.name
    assert len(d1.bodies) == 1

    status = {b["name"]: b for b in (await status_of(client))["backends"]}
    assert status[d1.name]["draining"] is True and status[d1.name]["outstanding"] == 1
    assert status[d0.name]["draining"] is False
    metrics = await (await client.get("/metrics")).text()
    assert f'pd_router_backend_draining{{backend="{d1.name}",role="decode"}} 1.0' in metrics

    d1.behaviour = "ok"
    d1.release.set()
    assert (await second).status == 200, "a draining engine's request completes"
    status = {b["name"]: b for b in (await status_of(client))["backends"]}
    assert status[d1.name]["outstanding"] == 0
    assert all(b["kv_held"] == 0 for b in status.values()), "every prefill let go of its KV once decode began"


async def test_with_every_decode_draining_the_router_is_not_ready(cluster, make_router):
    client = await make_router(mode="push")
    router = client.server.app[ROUTER_KEY]
    config = router.config
    for engine in cluster.decode:
        config = drained(config, engine.name) if engine is cluster.decode[0] else config
    both = config.model_copy(
        update={
            "decode": config.decode.model_copy(
                update={"backends": [b.model_copy(update={"draining": True}) for b in config.decode.backends]}
            )
        }
    )
    router.apply_config(both)
    response = await client.post("/v1/completions", json=COMPLETION)
    assert response.status == 503
    assert "draining" in (await response.json())["error"]["message"]
