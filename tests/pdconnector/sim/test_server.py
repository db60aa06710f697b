"""The mock engine's OpenAI endpoints in the co-located role, and its refusals."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pdconnector.protocol.params import TransferMode, mint_transfer_id, prefill_leg_params
from pdconnector.sim.engine import EngineSettings, LatencyModel, MockEngine, Role
from pdconnector.sim.metrics import EngineMetrics
from pdconnector.sim.model import chat_prompt, reference_tokens, tokenize
from pdconnector.sim.pool import KVPool
from pdconnector.sim.server import create_engine_app

MODEL = "tiny"


@pytest.fixture
async def engine_client():
    clients = []

    async def make(role: Role = Role.BOTH, num_blocks: int = 64, decode_s: float = 0.0) -> tuple[TestClient, KVPool]:
        pool = KVPool(num_blocks, 4)
        engine = MockEngine(
            EngineSettings(role=role, engine_id="e0", latency=LatencyModel(decode_s_per_token=decode_s)), pool, None, EngineMetrics(pool)
        )
        client = TestClient(TestServer(create_engine_app(engine, MODEL, compat_hash="abc")))
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
    body = await (await client.post("/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 5})).json()
    choice = body["choices"][0]
    assert choice["token_ids"] == expected(tokenize("a b c"), 5)
    assert tokenize(choice["text"]) == choice["token_ids"]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    token_prompt = await (await client.post("/v1/completions", json={"model": MODEL, "prompt": [7, 8], "max_tokens": 2})).json()
    assert token_prompt["choices"][0]["token_ids"] == expected([7, 8], 2)
    assert pool.free_blocks == 64


async def test_streamed_chat_has_role_delta_tokens_usage_and_done(engine_client):
    client, pool = await engine_client()
    messages = [{"role": "user", "content": "hi"}]
    response = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
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


async def test_client_leaving_mid_stream_frees_the_blocks(engine_client):
    client, pool = await engine_client(decode_s=0.05)
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "a b c d e", "max_tokens": 200, "stream": True})
    await response.content.readline()
    assert pool.free_blocks == 62
    response.close()
    for _ in range(100):
        if pool.free_blocks == 64:
            break
        await asyncio.sleep(0.02)
    assert pool.free_blocks == 64


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "other", "prompt": "x"}, 404, "model_not_found"),
        ({"model": MODEL, "prompt": ""}, 400, "empty_prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "invalid_max_tokens"),
        ({"model": MODEL, "prompt": "x", "kv_transfer_params": {"do_remote_decode": "yes"}}, 400, "invalid_kv_transfer_params"),
        ({"model": MODEL, "prompt": "x", "kv_transfer_params": prefill_leg_params(TransferMode.PULL, mint_transfer_id())}, 400, "wrong_role"),
    ],
)
async def test_bad_requests_are_refused_with_a_named_code(engine_client, body, status, code):
    client, pool = await engine_client()
    response = await client.post("/v1/completions", json=body)
    assert response.status == status
    assert (await response.json())["error"]["code"] == code
    assert pool.free_blocks == 64


async def test_full_pool_answers_503_and_keeps_serving(engine_client):
    client, _ = await engine_client(num_blocks=2)
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 9})
    assert response.status == 503
    assert (await response.json())["error"]["code"] == "kv_cache_full"
    assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 8})).status == 200


async def test_health_advertises_identity_and_metrics_show_pool_occupancy(engine_client):
    client, _ = await engine_client()
    assert await (await client.get("/health")).json() == {"status": "ok", "engine_id": "e0", "role": "both", "compat_hash": "abc", "kv_device": "cpu"}
    metrics = await (await client.get("/metrics")).text()
    assert "pd_mock_kv_blocks_free 64.0" in metrics and "pd_mock_kv_blocks_total 64.0" in metrics
