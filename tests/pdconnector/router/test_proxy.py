"""The request path through a real router app to fake engines: legs, headers, verification, failures."""

from __future__ import annotations

import asyncio
import json

import pytest
from pdconnector.protocol.params import RECEIVED_KEY
from pdconnector.router.app import RouterOptions
from pdconnector.router.health import HealthSettings
from pdconnector.router.proxy import Dispatch

MODEL = "tiny"
COMPLETION = {"model": MODEL, "prompt": "hello there", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


async def until(condition, timeout=3.0):
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def status_of(client):
    return await (await client.get("/status")).json()


async def test_pull_sends_prefill_leg_then_decode_leg_with_returned_params(cluster, make_router):
    client = await make_router(mode="pull")
    response = await client.post(
        "/v1/completions",
        json={**COMPLETION, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 2},
    )
    assert response.status == 200
    await response.read()
    prefill = next(e for e in cluster.prefill if e.bodies)
    decode = next(e for e in cluster.decode if e.bodies)
    leg = prefill.bodies[0]
    assert leg["max_tokens"] == 1 and leg["stream"] is False
    assert "stream_options" not in leg and "min_tokens" not in leg
    assert (
        leg["kv_transfer_params"]["do_remote_decode"] is True
        and leg["kv_transfer_params"]["transfer_mode"] == "pull"
    )
    decode_params = decode.bodies[0]["kv_transfer_params"]
    assert decode_params["remote_block_ids"] == [[1, 2]] and decode_params["remote_engine_id"] == prefill.name
    assert decode_params["transfer_id"] == leg["kv_transfer_params"]["transfer_id"]
    assert response.headers["x-pd-prefill"] == prefill.name and response.headers["x-pd-decode"] == decode.name


async def test_push_dispatches_both_legs_concurrently_with_prefill_coordinates(cluster, make_router):
    # Each fake answers only once the other leg has arrived: a sequential router would time out here.
    for p in cluster.prefill:
        p.wait_for = cluster.decode[0]
    cluster.decode[0].wait_for = cluster.prefill[0]
    cluster.decode[1].wait_for = cluster.prefill[0]
    client = await make_router(mode="push")
    response = await client.post("/v1/completions", json=COMPLETION)
    assert response.status == 200, await response.text()
    decode = next(e for e in cluster.decode if e.bodies)
    prefill = next(e for e in cluster.prefill if e.bodies)
    params = decode.bodies[0]["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["transfer_mode"] == "push"
    assert (
        params["remote_engine_id"] == f"{prefill.name}-c0ffee"
        and params["remote_host"] == prefill.host
        and params["remote_port"] == 5600
    )
    assert params["transfer_id"] == prefill.bodies[0]["kv_transfer_params"]["transfer_id"]


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [("/v1/completions", COMPLETION, "cmpl-req-7-0"), ("/v1/chat/completions", CHAT, "chatcmpl-req-7")],
)
async def test_push_to_upstream_vllm_connectors_names_the_prefill_request_it_pairs_with(
    cluster, make_router, endpoint, body, expected
):
    client = await make_router(mode="push", connector="vllm")
    response = await client.post(endpoint, json=body, headers={"X-Request-Id": "req-7"})
    assert response.status == 200, await response.text()
    decode = next(e for e in cluster.decode if e.bodies)
    assert decode.bodies[0]["kv_transfer_params"]["remote_request_id"] == expected
    # Upstream engines never confirm how KV arrived: the request proves nothing, rather than "served without
    # transfer".
    assert (await status_of(client))["transfers"] == {"verified": 0, "unverified": 0, "unconfirmable": 1}


async def test_push_to_our_connector_sends_no_upstream_request_id(cluster, make_router):
    response = await (await make_router(mode="push")).post("/v1/completions", json=COMPLETION)
    assert response.status == 200
    assert (
        "remote_request_id" not in next(e for e in cluster.decode if e.bodies).bodies[0]["kv_transfer_params"]
    )


async def test_push_sequential_sends_decode_leg_only_after_prefill_answered(cluster, make_router):
    client = await make_router(options=RouterOptions(dispatch=Dispatch.PUSH_SEQUENTIAL), mode="push")
    assert (await client.post("/v1/completions", json=COMPLETION)).status == 200
    for engine in cluster.prefill + cluster.decode:
        engine.arrived = asyncio.Event()
    for d in cluster.decode:
        d.wait_for = cluster.prefill[0]
    # would need concurrency: sequential dispatch cannot satisfy it
    cluster.prefill[0].wait_for = cluster.decode[0]
    cluster.prefill[1].wait_for = cluster.decode[0]
    response = await client.post("/v1/completions", json=COMPLETION)
    assert response.status == 504
    assert (await response.json())["error"]["code"] == "prefill_timeout"


async def test_non_streaming_answer_is_passed_through_and_counted_verified(cluster, make_router):
    client = await make_router()
    response = await client.post("/v1/completions", json=COMPLETION)
    body = await response.json()
    assert body["choices"][0]["text"] == " t1 t2 t3"
    assert RECEIVED_KEY in body["kv_transfer_params"]
    assert (await status_of(client))["transfers"] == {"verified": 1, "unverified": 0, "unconfirmable": 0}


@pytest.mark.parametrize("stream", [False, True])
async def test_each_leg_is_timed_per_mode_and_role(cluster, make_router, stream):
    client = await make_router(mode="pull")
    response = await client.post("/v1/completions", json={**COMPLETION, "stream": stream})
    await response.read()
    exposition = await (await client.get("/metrics")).text()
    for role in ("prefill", "decode"):
        assert f'pd_router_leg_seconds_count{{mode="pull",role="{role}"}} 1.0' in exposition


async def test_streaming_is_relayed_event_by_event_and_verified_from_final_chunk(cluster, make_router):
    client = await make_router()
    response = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in (await response.text()).split("\n\n") if line]
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:3]] == [" t0", " t1", " t2"]
    assert events[-1] == "data: [DONE]"
    assert (await status_of(client))["transfers"] == {"verified": 1, "unverified": 0, "unconfirmable": 0}


async def test_answer_reporting_no_receipt_counts_as_unverified(cluster, make_router):
    # What vLLM answers when its connector did not load the KV (or no connector is loaded): the field, null.
    for d in cluster.decode:
        d.decode_answer = lambda body: {"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": None}  # type: ignore[method-assign]
    client = await make_router()
    assert (await client.post("/v1/completions", json=COMPLETION)).status == 200
    assert (await status_of(client))["transfers"] == {"verified": 0, "unverified": 1, "unconfirmable": 0}


async def test_answers_that_say_nothing_about_their_kv_count_as_unconfirmable_not_as_served_without_transfer(
    cluster, make_router
):
    # vLLM's streams never carry kv_transfer_params: counting them unverified would cry "no transfer" on every
    # chat client.
    for d in cluster.decode:
        d.stream_reports = False
        d.decode_answer = lambda body: {"choices": [{"index": 0, "text": "x"}]}  # type: ignore[method-assign]
    client = await make_router()
    streamed = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert streamed.status == 200 and (await streamed.text()).endswith("data: [DONE]\n\n")
    assert (await client.post("/v1/completions", json=COMPLETION)).status == 200
    assert (await status_of(client))["transfers"] == {"verified": 0, "unverified": 0, "unconfirmable": 2}


async def test_connect_error_is_retried_on_another_backend(cluster, make_router):
    await cluster.stop(cluster.prefill[0])
    await cluster.stop(cluster.decode[0])
    slow_health = RouterOptions(health=HealthSettings(interval_s=60, failures_to_eject=1))
    for mode in ("push", "pull"):
        client = await make_router(options=slow_health, mode=mode)
        for _ in range(3):
            response = await client.post("/v1/completions", json=COMPLETION)
            assert response.status == 200, await response.text()
            assert response.headers["x-pd-prefill"] == "p1" and response.headers["x-pd-decode"] == "d1"
        assert "pd_router_retries_total" in await (await client.get("/metrics")).text()


# Deadlines far beyond what the tests allow themselves: an answer that comes fast did not wait one out.
PATIENT = {"connect_s": 1, "prefill_s": 30, "transfer_s": 30, "decode_first_token_s": 30}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "failure",  # the prefills' behaviour, the detail the client reads, the retry's cause
    [
        ("error500", "HTTP 500: engine exploded", "status"),
        ("pd_error", "it kept no KV for decode: transfer_id missing", "reported"),
    ],
)
async def test_each_failed_push_prefill_ends_its_waiting_decode_leg_and_the_last_names_engine_and_transfer(
    cluster, make_router, failure, stream
):
    """Each prefill fails once the decode leg is in flight: each attempt ends its decode leg at once and the
    request is tried on the other prefill; with none left, the client hears the last failure."""
    behaviour, detail, cause = failure
    decode = cluster.decode[0]
    decode.behaviour = "hang"  # as a decode engine waiting for KV that prefill will never write
    for p in cluster.prefill:
        p.behaviour = behaviour
        p.wait_for = decode  # fail only once the decode leg is in flight, so it must be ended
    client = await make_router(mode="push", timeouts=PATIENT, decode_engines=[decode])
    loop = asyncio.get_running_loop()
    started = loop.time()
    response = await client.post("/v1/completions", json={**COMPLETION, "stream": stream})
    assert loop.time() - started < 1.0
    assert response.status == 502
    transfer_id = response.headers["x-pd-transfer-id"]
    last = next(
        p for p in cluster.prefill if p.bodies[-1]["kv_transfer_params"]["transfer_id"] == transfer_id
    )
    assert all(len(p.bodies) == 1 for p in cluster.prefill)  # one attempt on each, then none left
    error = (await response.json())["error"]
    assert error["code"] == "prefill_failed"
    assert error["message"] == (
        f"The prefill leg failed on {last.name} (engine id {last.name}-c0ffee, "
        f"http://{last.host}:{cluster.prefill_port})"
        f" for transfer {transfer_id}: {detail}"
    )
    await until(lambda: decode.cancelled == 2)
    metrics = await (await client.get("/metrics")).text()
    assert f'pd_router_retries_total{{cause="{cause}",role="prefill"}} 1.0' in metrics, [
        line for line in metrics.splitlines() if "retries_total{" in line
    ]
    for engine in cluster.prefill + cluster.decode:
        engine.behaviour = "ok"
    assert (await client.post("/v1/completions", json=COMPLETION)).status == 200


async def test_a_pull_prefill_reporting_pd_error_is_its_failure_not_a_bad_decode_request(
    cluster, make_router
):
    for p in cluster.prefill:
        p.behaviour = "pd_error"
    response = await (await make_router(mode="pull")).post("/v1/completions", json=COMPLETION)
    assert response.status == 502
    assert "kept no KV for decode" in (await response.json())["error"]["message"]
    assert not any(d.bodies for d in cluster.decode)


async def test_push_relays_decode_without_waiting_for_the_prefill_answer(cluster, make_router):
    # Decode answering means its KV arrived: prefill's own answer adds nothing the client must wait for.
    for p in cluster.prefill:
        p.behaviour = "hang"
    client = await make_router(mode="push", timeouts=PATIENT)
    for stream in (False, True):
        response = await client.post("/v1/completions", json={**COMPLETION, "stream": stream})
        assert response.status == 200
        assert (await response.text()).endswith("data: [DONE]\n\n" if stream else "}")
    await until(lambda: sum(p.cancelled for p in cluster.prefill) == 2)


async def test_push_with_every_prefill_down_is_a_prompt_503_naming_each_and_recovers(cluster, make_router):
    for p in cluster.prefill:
        await cluster.stop(p)
    client = await make_router(mode="push", timeouts=PATIENT)
    response = await client.post("/v1/completions", json=COMPLETION)
    assert response.status == 503, await response.text()
    assert response.headers["Retry-After"] == "1"
    error = (await response.json())["error"]
    assert error["code"] == "no_prefill_backend"
    assert error["message"].startswith("No healthy prefill backend is available: p0: ejected (")
    assert "; p1: ejected (" in error["message"] and "cannot connect" in error["message"]
    for p in cluster.prefill:
        await cluster.start(p)
    for _ in range(50):  # the next passed health check re-admits them
        if all(b["healthy"] for b in (await status_of(client))["backends"]):
            break
        await asyncio.sleep(0.05)
    assert (await client.post("/v1/completions", json=COMPLETION)).status == 200


async def test_each_failed_decode_leg_aborts_its_running_prefill_leg(cluster, make_router):
    for p in cluster.prefill:
        p.behaviour = "hang"
    for d in cluster.decode:
        d.behaviour = "error500"
    client = await make_router(mode="push", policy="round-robin")
    response = await client.post("/v1/completions", json=COMPLETION)
    assert response.status == 502
    # one attempt on each decode, each with its own prefill leg, each ended when its decode leg failed
    assert [len(d.bodies) for d in cluster.decode] == [1, 1]
    await until(lambda: sum(p.cancelled for p in cluster.prefill) == 2)


async def test_transfer_failure_reported_by_decode_is_a_transfer_error(cluster, make_router):
    for d in cluster.decode:
        d.behaviour = "transfer_failed"
    client = await make_router()
    response = await client.post("/v1/completions", json=COMPLETION)
    assert response.status == 502
    assert (await response.json())["error"]["code"] == "kv_transfer_failed"
    assert "pd_router_transfer_failures_total 1.0" in await (await client.get("/metrics")).text()


async def test_pull_prefill_without_returned_params_is_a_transfer_error(cluster, make_router):
    for p in cluster.prefill:
        p.prefill_answer = lambda body: {"choices": []}  # type: ignore[method-assign]
    client = await make_router(mode="pull")
    response = await client.post("/v1/completions", json=COMPLETION)
    assert response.status == 502
    assert "returned no kv_transfer_params" in (await response.json())["error"]["message"]


async def test_hanging_prefill_times_out_with_504(cluster, make_router):
    for p in cluster.prefill:
        p.behaviour = "hang"
    client = await make_router(mode="pull")
    response = await client.post("/v1/completions", json=COMPLETION)
    assert response.status == 504
    assert (await response.json())["error"]["type"] == "timeout"


async def test_decode_dying_mid_stream_ends_the_stream_with_an_error_event(cluster, make_router):
    for d in cluster.decode:
        d.behaviour = "die_mid_stream"
    client = await make_router()
    response = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert response.status == 200
    events = [e for e in (await response.text()).split("\n\n") if e]
    assert json.loads(events[0][6:])["choices"][0]["text"] == " t0"
    assert "error" in json.loads(events[-1][6:])
    assert (await status_of(client))["transfers"] == {"verified": 0, "unverified": 0, "unconfirmable": 0}


async def test_client_disconnect_cancels_both_legs(cluster, make_router):
    for engine in cluster.prefill + cluster.decode:
        engine.behaviour = "hang"
    client = await make_router(mode="push")
    request = asyncio.ensure_future(client.post("/v1/completions", json=COMPLETION))
    await until(lambda: sum(len(e.bodies) for e in cluster.prefill + cluster.decode) == 2)
    request.cancel()
    await until(lambda: sum(e.cancelled for e in cluster.prefill + cluster.decode) == 2)
    assert sum(e.cancelled for e in cluster.prefill) == 1 and sum(e.cancelled for e in cluster.decode) == 1
    status = await status_of(client)
    assert all(b["outstanding"] == 0 for b in status["backends"])
