"""Retries before the first token, and legs ended by ejection.

A request whose leg failed for a reason of the engine's is tried again on another pair, with a new transfer
id, as long as nothing reached its client and its budget (attempts, seconds) allows; the engine that failed is
not tried again for it. Every leg in flight on an engine the health checks eject ends at once. After the first
token the client gets a clean end of stream with an error event instead. Retries, their causes and their cost
are on /metrics.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from pdconnector.router.app import RouterOptions
from pdconnector.router.health import HealthSettings

from tests.pdconnector.router.conftest import KV_WAIT_S, MODEL

COMPLETION = {"model": MODEL, "prompt": "t1 t2 t3", "max_tokens": 3}
PATIENT = {"connect_s": 1, "prefill_s": 30, "transfer_s": 30, "decode_first_token_s": 30}
# Probes every 0.2 s, each given 0.2 s, two failures in a row eject: a frozen engine is out within ~1 s.
QUICK_EJECTION = RouterOptions(
    health=HealthSettings(interval_s=0.2, timeout_s=0.2, failures_to_eject=2), refresh_interval_s=0.1
)


def counter(metrics: str, sample: str) -> float:
    """The value of one sample (``name{labels}``) in a /metrics text; 0 when absent."""
    for line in metrics.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("mode", ["push", "pull"])
async def test_twelve_requests_with_one_prefill_frozen_are_all_served_by_the_other_soon_after_its_ejection(
    cluster, make_router, mode
):
    frozen, healthy = cluster.prefill
    frozen.behaviour = "hang"  # SIGSTOP: its legs never answer, nor its /health
    frozen.health_stalls = math.inf
    for decode in cluster.decode:
        decode.kv_sources = cluster.prefill  # push: decode answers only once its KV was written
    client = await make_router(options=QUICK_EJECTION, mode=mode, policy="round-robin", timeouts=PATIENT)
    loop = asyncio.get_running_loop()
    started = loop.time()

    responses = await asyncio.gather(*(client.post("/v1/completions", json=COMPLETION) for _ in range(12)))

    assert [r.status for r in responses] == [200] * 12, [await r.text() for r in responses]
    assert {r.headers["x-pd-prefill"] for r in responses} == {healthy.name}
    assert loop.time() - started < 5.0  # ejection within ~1 s; not a leg timeout (30 s here)
    assert frozen.bodies, "round-robin sent some requests to the frozen prefill before its ejection"
    metrics = await (await client.get("/metrics")).text()
    assert counter(metrics, 'pd_router_retries_total{cause="ejected",role="prefill"}') == len(frozen.bodies)
    assert counter(metrics, 'pd_router_retry_seconds_total{cause="ejected"}') > 0
    # each retry had its own transfer: no two legs on the healthy prefill share one
    transfer_ids = [body["kv_transfer_params"]["transfer_id"] for body in healthy.bodies]
    assert len(set(transfer_ids)) == len(transfer_ids) == 12


async def test_a_transfer_decode_reports_failed_is_retried_on_another_prefill(cluster, make_router):
    silent, working = cluster.prefill
    silent.prefill_answer = lambda body: {"choices": [{"index": 0, "text": " t1"}]}  # type: ignore[method-assign]
    silent.behaviour = "hang"  # computes, never writes: decode times its transfer out
    silent.health_stalls = 0
    decode = cluster.decode[0]
    decode.kv_sources = [working]
    client = await make_router(mode="push", policy="round-robin", timeouts=PATIENT, decode_engines=[decode])
    loop = asyncio.get_running_loop()
    answers = []
    for _ in range(2):  # round-robin: each may start on the silent prefill
        started = loop.time()
        response = await client.post("/v1/completions", json=COMPLETION)
        answers.append((response.status, response.headers["x-pd-prefill"], loop.time() - started))
    assert [(status, prefill) for status, prefill, _ in answers] == [(200, working.name)] * 2
    assert max(seconds for *_, seconds in answers) < KV_WAIT_S + 2
    metrics = await (await client.get("/metrics")).text()
    assert silent.bodies
    retried = counter(metrics, 'pd_router_retries_total{cause="kv_transfer",role="decode"}')
    assert retried == len(silent.bodies)
    assert counter(metrics, "pd_router_transfer_failures_total") == 0  # no request failed by it


async def test_a_decode_aborting_the_request_at_shutdown_is_retried_on_the_other_decode(cluster, make_router):
    stopping, serving = cluster.decode
    stopping.behaviour = "aborted"
    client = await make_router(mode="push", policy="round-robin")
    for _ in range(2):
        response = await client.post("/v1/completions", json=COMPLETION)
        assert response.status == 200 and response.headers["x-pd-decode"] == serving.name
        assert (await response.json())["choices"][0]["finish_reason"] == "length"
    metrics = await (await client.get("/metrics")).text()
    assert stopping.bodies
    assert counter(metrics, 'pd_router_retries_total{cause="aborted",role="decode"}') == len(stopping.bodies)


async def test_a_stream_whose_first_event_is_an_error_is_retried_on_the_other_decode(cluster, make_router):
    failing, serving = cluster.decode
    failing.behaviour = "stream_error"
    client = await make_router(mode="push", policy="round-robin")
    for _ in range(2):
        response = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
        text = await response.text()
        assert response.status == 200 and response.headers["x-pd-decode"] == serving.name
        assert text.endswith("data: [DONE]\n\n") and '"error"' not in text
    metrics = await (await client.get("/metrics")).text()
    assert (
        counter(metrics, 'pd_router_retries_total{cause="status",role="decode"}') == len(failing.bodies) > 0
    )


@pytest.mark.parametrize(
    "retries",
    [{"attempts": 1, "budget_s": 30}, {"attempts": 3, "budget_s": 0.001}],
    ids=["one attempt", "budget spent"],
)
async def test_a_failure_the_budget_leaves_no_retry_for_is_answered_at_once(cluster, make_router, retries):
    for decode in cluster.decode:
        decode.behaviour = "error500"
    client = await make_router(mode="pull", retries=retries)
    response = await client.post("/v1/completions", json=COMPLETION)
    assert response.status == 502
    assert (await response.json())["error"]["code"] == "decode_failed"
    assert sum(len(d.bodies) for d in cluster.decode) == 1
    assert "pd_router_retries_total{" not in await (await client.get("/metrics")).text()


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_the_engines_judgement_of_the_request_is_the_clients_error_and_not_retried(
    cluster, make_router, role
):
    engines = cluster.prefill if role == "prefill" else cluster.decode
    for engine in engines:
        engine.behaviour = "reject400"
    client = await make_router(mode="pull")
    response = await client.post("/v1/completions", json=COMPLETION)
    assert response.status == 400
    assert "prompt too long" in (await response.json())["error"]["message"]
    assert sum(len(engine.bodies) for engine in engines) == 1


async def test_ejecting_a_decode_ends_its_stream_after_the_first_token_with_an_error_event(
    cluster, make_router
):
    decode = cluster.decode[0]
    decode.behaviour = "stall_mid_stream"
    client = await make_router(options=QUICK_EJECTION, mode="push", timeouts=PATIENT, decode_engines=[decode])
    response = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert response.status == 200
    first = await response.content.readline()
    assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == " t0"
    decode.health_stalls = math.inf  # frozen mid-stream
    rest = await asyncio.wait_for(response.text(), timeout=5)
    events = [json.loads(line.strip().removeprefix("data: ")) for line in rest.split("\n\n") if line.strip()]
    assert "error" in events[-1], rest
    assert events[-1]["error"]["code"] == "decode_failed"
    assert "ejected while the leg was in flight" in events[-1]["error"]["message"]
    assert "[DONE]" not in rest
    await asyncio.sleep(0.1)
    assert decode.cancelled == 1  # its connection was closed: a real engine aborts the request
