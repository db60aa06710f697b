"""The mock engine's OpenAI endpoints in the co-located role, its refusals, and how it stays responsive."""

from __future__ import annotations

import asyncio
import gc
import json
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from pdconnector.protocol.params import EngineRole, TransferMode, mint_transfer_id, prefill_leg_params
from pdconnector.sim.engine import EngineSettings, MockEngine
from pdconnector.sim.metrics import EngineMetrics
from pdconnector.sim.model import chat_prompt, reference_tokens, tokenize
from pdconnector.sim.pool import KVPool
from pdconnector.sim.scheduler import LatencyModel
from pdconnector.sim.server import create_engine_app

from tests.pdconnector.sim.engines import eventually, metrics, serving

MODEL = "tiny"
CONTEXT = 64  # the test engines' max_model_len unless a test needs a longer one
HEALTH_BUDGET_S = 0.1  # the most a health check may wait on the engine's other work


@pytest.fixture
async def engine_client():
    clients = []

    async def make(
        role: EngineRole | None = None,
        num_blocks: int = 64,
        decode_s: float = 0.0,
        max_model_len: int = CONTEXT,
        block_size: int = 4,
    ) -> tuple[TestClient, KVPool]:
        pool = KVPool(num_blocks, block_size)
        settings = EngineSettings(
            role=role,
            engine_id="e0",
            latency=LatencyModel(decode_s_per_token=decode_s),
            max_model_len=max_model_len,
        )
        engine = MockEngine(settings, pool, None, EngineMetrics(pool))
        client = TestClient(serving(create_engine_app(engine, MODEL, compat_hash="abc")))
        await client.start_server()
        clients.append(client)
        return client, pool

    yield make
    for client in clients:
        await client.close()


def expected(tokens: list[int], count: int) -> list[int]:
    return reference_tokens(tokens, count, block_size=4)


async def test_completion_output_is_computed_from_the_prompt_kv(engine_client):
    client, pool = await engine_client()
    body = await (
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 5})
    ).json()
    choice = body["choices"][0]
    assert choice["token_ids"] == expected(tokenize("a b c"), 5)
    assert tokenize(choice["text"]) == choice["token_ids"]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    token_prompt = await (
        await client.post("/v1/completions", json={"model": MODEL, "prompt": [7, 8], "max_tokens": 2})
    ).json()
    assert token_prompt["choices"][0]["token_ids"] == expected([7, 8], 2)
    assert pool.free_blocks == 64


async def test_streamed_chat_has_role_delta_tokens_usage_and_done(engine_client):
    client, pool = await engine_client()
    messages = [{"role": "user", "content": "hi"}]
    response = await client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": messages,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = [e[6:] for e in (await response.text()).split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert tokenize(text) == expected(tokenize(chat_prompt(messages)), 3)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert pool.free_blocks == 64


async def test_a_streaming_client_that_disconnects_stops_its_generation_and_frees_its_blocks_within_a_second(
    engine_client,
):
    client, pool = await engine_client(decode_s=0.01)
    response = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "a b c d e", "max_tokens": 50, "stream": True}
    )
    await response.content.readline()
    assert pool.free_blocks == 62
    response.close()

    assert await eventually(lambda: pool.free_blocks == 64, within_s=1.0)
    generated = (await metrics(client))["pd_mock_generation_tokens_total"]
    await asyncio.sleep(0.1)  # ten decode steps: a generation still running would have moved on
    after = await metrics(client)
    assert after["pd_mock_generation_tokens_total"] == generated < 50
    assert after["pd_mock_requests_total{kind=completion,outcome=cancelled}"] == 1


async def test_a_non_streaming_client_that_gives_up_stops_its_generation_and_frees_its_blocks(engine_client):
    client, pool = await engine_client(decode_s=0.01)
    with pytest.raises(TimeoutError):
        await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "a b c", "max_tokens": 50},
            timeout=aiohttp.ClientTimeout(total=0.1),
        )

    assert await eventually(lambda: pool.free_blocks == 64, within_s=1.0)
    generated = (await metrics(client))["pd_mock_generation_tokens_total"]
    await asyncio.sleep(0.1)  # ten decode steps
    assert (await metrics(client))["pd_mock_generation_tokens_total"] == generated < 50


@pytest.fixture
def engine_sized_heap():
    """Takes what this test process already holds (other suites' imports, torch's included) out of the garbage
    collector's sight, so that a full collection during a measurement costs what it would in
    pd-mock-engine."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


async def health_waits_while(busy: asyncio.Task, client: TestClient) -> list[float]:
    """How long each health check waited on the engine's other work, asked one after another for as long as
    ``busy`` runs.

    Measured in CPU time of the thread serving the engine (and the client): what the engine's own work costs a
    health check, without the time other processes on a shared machine take from this one.
    """
    waits = []
    while not busy.done():
        start = time.thread_time()
        assert (await client.get("/health")).status == 200
        waits.append(time.thread_time() - start)
    return waits


@pytest.mark.usefixtures("engine_sized_heap")
async def test_health_answers_within_100_ms_while_a_generation_runs_flat_out(engine_client):
    # No per-token latency and a context of 10**6 tokens: the engine has all the work it could want.
    client, pool = await engine_client(max_model_len=1_000_000)
    body = {"model": MODEL, "prompt": "a b c", "max_tokens": 999_000}
    generation = asyncio.create_task(
        client.post("/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=1.0))
    )
    waits = await health_waits_while(generation, client)
    assert len(waits) >= 5 and max(waits) < HEALTH_BUDGET_S
    with pytest.raises(TimeoutError):
        await generation  # still generating after a second; the client gives up, and the engine with it

    assert await eventually(lambda: pool.free_blocks == 64, within_s=1.0)


@pytest.mark.usefixtures("engine_sized_heap")
async def test_health_answers_within_100_ms_while_a_long_prompt_is_prefilled(engine_client):
    client, pool = await engine_client(num_blocks=1024, block_size=16, max_model_len=16384)
    prompt = [7] * 16000
    prefill = asyncio.create_task(
        client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    )
    waits = await health_waits_while(prefill, client)
    assert len(waits) >= 5 and max(waits) < HEALTH_BUDGET_S
    assert (await prefill).status == 200
    assert pool.free_blocks == 1024


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "other", "prompt": "x"}, 404, "model_not_found"),
        ({"model": MODEL, "prompt": ""}, 400, "empty_prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "invalid_max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "invalid_max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 2.5}, 400, "invalid_max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "invalid_max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": True}, 400, "invalid_max_tokens"),
        ({"model": MODEL, "prompt": [1, -2]}, 400, "invalid_prompt"),
        (
            {"model": MODEL, "prompt": "x", "kv_transfer_params": {"do_remote_decode": "yes"}},
            400,
            "invalid_kv_transfer_params",
        ),
        (
            {
                "model": MODEL,
                "prompt": "x",
                "kv_transfer_params": prefill_leg_params(TransferMode.PULL, mint_transfer_id()),
            },
            400,
            "wrong_role",
        ),
    ],
)
async def test_bad_requests_are_refused_with_a_named_code(engine_client, body, status, code):
    client, pool = await engine_client()
    response = await client.post("/v1/completions", json=body)
    assert response.status == status
    assert (await response.json())["error"]["code"] == code
    assert pool.free_blocks == 64


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"prompt": "a b c", "max_tokens": 100_000_000}, "max_tokens"),
        (
            "/v1/completions",
            {"prompt": [1] * 60, "max_tokens": 5},
            "max_tokens",
        ),  # 65 tokens: one more than the context
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100},
            "max_completion_tokens",
        ),
        ("/v1/completions", {"prompt": [1] * 64, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": "word " * 1_000_000}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 100}]}, "messages"),
    ],
)
async def test_a_request_beyond_the_context_length_is_refused_naming_the_field(
    engine_client, path, body, field
):
    client, pool = await engine_client()
    response = await client.post(path, json={"model": MODEL, **body})
    assert response.status == 400
    error = (await response.json())["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", field)
    assert f"maximum context length is {CONTEXT} tokens" in error["message"] and field in error["message"]
    assert pool.free_blocks == 64


async def test_a_request_that_fills_the_context_exactly_is_served(engine_client):
    client, _ = await engine_client()
    body = await (
        await client.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 60, "max_tokens": 4})
    ).json()
    assert body["usage"]["total_tokens"] == CONTEXT


async def test_without_max_tokens_the_output_stops_at_the_context_length(engine_client):
    client, _ = await engine_client()
    body = await (await client.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 60})).json()
    assert body["usage"]["completion_tokens"] == 4


async def test_full_pool_answers_503_and_keeps_serving(engine_client):
    client, _ = await engine_client(num_blocks=2)
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 9})
    assert response.status == 503
    assert (await response.json())["error"]["code"] == "kv_cache_full"
    assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 8})).status == 200


async def test_health_advertises_identity_and_metrics_show_pool_occupancy(engine_client):
    client, _ = await engine_client()
    assert await (await client.get("/health")).json() == {
        "status": "ok",
        "engine_id": "e0",
        "role": "both",
        "compat_hash": "abc",
        "kv_device": "cpu",
    }
    metrics = await (await client.get("/metrics")).text()
    assert "pd_mock_kv_blocks_free 64.0" in metrics and "pd_mock_kv_blocks_total 64.0" in metrics


async def test_tokenize_gives_the_token_ids_a_completion_of_the_same_prompt_would_run_on(engine_client):
    client, _ = await engine_client()
    for body, ids in (
        ({"model": MODEL, "prompt": "t5 t6 hello"}, tokenize("t5 t6 hello")),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            tokenize(chat_prompt([{"role": "user", "content": "hi"}])),
        ),
    ):
        response = await client.post("/tokenize", json=body)
        assert response.status == 200
        assert await response.json() == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids}
    for bad in ("[1,", json.dumps([1, 2]), json.dumps({"prompt": []})):
        response = await client.post("/tokenize", data=bad, headers={"Content-Type": "application/json"})
        assert response.status == 400, bad
        assert (await response.json())["error"]["type"] == "invalid_request_error"
