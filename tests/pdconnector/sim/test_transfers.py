"""Two in-process mock engines moving KV through the connector core's transfer worker (TCP mock transport)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from pdconnector.protocol.params import (
    EngineRole,
    PrefillCoordinates,
    TransferMode,
    mint_transfer_id,
    prefill_leg_params,
    pull_decode_leg_params,
    push_decode_leg_params,
)
from pdconnector.sim.model import reference_tokens
from pdconnector.sim.movers import create_mover, mover_unavailable_reason
from pdconnector.sim.pool import KVPool

from tests.pdconnector.sim.engines import PROMPT, engine_servers, eventually, leg, metrics


@pytest.fixture(autouse=True)
def _mock_mover_available() -> None:
    if (reason := mover_unavailable_reason("mock")) is not None:
        pytest.fail(f"the mock engine must be able to move KV here: {reason}")


@pytest.fixture
async def pair():
    async with engine_servers("mock") as serve:
        yield serve


async def test_pull_moves_the_prompt_kv_and_frees_both_sides(pair):
    (p_client, prefill), (d_client, decode) = (
        await pair(EngineRole.PREFILL, "p0"),
        await pair(EngineRole.DECODE, "d0"),
    )
    tid = mint_transfer_id()
    first = await (
        await p_client.post("/v1/completions", json=leg(prefill_leg_params(TransferMode.PULL, tid), 1))
    ).json()
    assert prefill.pool.free_blocks == 64 - 4  # held for the decode engine
    answer = await (
        await d_client.post(
            "/v1/completions", json=leg(pull_decode_leg_params(first["kv_transfer_params"], tid))
        )
    ).json()
    assert answer["choices"][0]["token_ids"] == reference_tokens(PROMPT, 5)
    assert answer["kv_transfer_params"]["pd_received"]["transfer_id"] == tid
    for _ in range(100):
        if prefill.pool.free_blocks == 64:
            break
        await asyncio.sleep(0.02)
    assert prefill.pool.free_blocks == 64 and decode.pool.free_blocks == 64


async def test_push_with_both_legs_at_once_gives_the_colocated_tokens(pair):
    (p_client, prefill), (d_client, decode) = (
        await pair(EngineRole.PREFILL, "p0"),
        await pair(EngineRole.DECODE, "d0"),
    )
    tid = mint_transfer_id()
    coordinates = prefill.mover.side_channel()
    decode_leg = asyncio.ensure_future(
        d_client.post("/v1/completions", json=leg(push_decode_leg_params(tid, coordinates)))
    )
    await p_client.post("/v1/completions", json=leg(prefill_leg_params(TransferMode.PUSH, tid), 1))
    answer = await (await decode_leg).json()
    assert answer["choices"][0]["token_ids"] == reference_tokens(PROMPT, 5)
    assert decode.pool.free_blocks == 64


async def test_push_without_a_prefill_times_out_with_a_transfer_code_and_frees_blocks(pair):
    (_, prefill), (d_client, decode) = (
        await pair(EngineRole.PREFILL, "p0"),
        await pair(EngineRole.DECODE, "d0", transfer_timeout_s=0.5),
    )
    response = await d_client.post(
        "/v1/completions", json=leg(push_decode_leg_params(mint_transfer_id(), prefill.mover.side_channel()))
    )
    assert response.status in (502, 504)
    assert (await response.json())["error"]["code"] in ("kv_transfer_timeout", "kv_transfer_failed")
    # answered at the deadline; the blocks come back once prefill answered decode's abort (nothing in flight)
    assert await eventually(lambda: decode.pool.free_blocks == 64, within_s=3.0)
    assert 'pd_mock_transfers_total{direction="import",outcome="failed"} 1.0' in (
        await (await d_client.get("/metrics")).text()
    )


async def test_pull_from_an_unreachable_prefill_fails_cleanly(pair):
    d_client, decode = await pair(EngineRole.DECODE, "d0", transfer_timeout_s=1.0)
    params = {
        "do_remote_prefill": True,
        "remote_block_ids": [[0, 1, 2, 3]],
        "remote_engine_id": "gone",
        "remote_host": "127.0.0.1",
        "remote_port": 9,
        "tp_size": 1,
    }
    response = await d_client.post(
        "/v1/completions", json=leg(pull_decode_leg_params(params, mint_transfer_id()))
    )
    assert response.status in (502, 504)
    assert "transfer" in (await response.json())["error"]["code"]
    assert decode.pool.free_blocks == 64


async def test_unclaimed_prefill_blocks_are_freed_when_the_lease_ends(pair):
    p_client, prefill = await pair(EngineRole.PREFILL, "p0", lease_s=0.3)
    await p_client.post(
        "/v1/completions", json=leg(prefill_leg_params(TransferMode.PULL, mint_transfer_id()), 1)
    )
    assert prefill.pool.free_blocks == 60
    for _ in range(100):
        if prefill.pool.free_blocks == 64:
            break
        await asyncio.sleep(0.05)
    assert prefill.pool.free_blocks == 64
    assert 'outcome="expired"' in await (await p_client.get("/metrics")).text()


async def test_a_push_decode_leg_whose_client_gives_up_while_waiting_for_kv_frees_its_blocks_within_a_second(
    pair,
):
    (_, prefill), (d_client, decode) = (
        await pair(EngineRole.PREFILL, "p0"),
        await pair(EngineRole.DECODE, "d0", transfer_timeout_s=30),
    )
    body = leg(push_decode_leg_params(mint_transfer_id(), prefill.mover.side_channel()))
    with pytest.raises(TimeoutError):
        await d_client.post("/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.2))

    # not the 30 s transfer timeout: the request is gone
    assert await eventually(lambda: decode.pool.free_blocks == 64, within_s=1.0)


async def test_a_pull_decode_leg_whose_client_disconnects_mid_stream_stops_and_frees_its_blocks(pair):
    (p_client, _), (d_client, decode) = (
        await pair(EngineRole.PREFILL, "p0"),
        await pair(EngineRole.DECODE, "d0", decode_s=0.01),
    )
    tid = mint_transfer_id()
    first = await (
        await p_client.post("/v1/completions", json=leg(prefill_leg_params(TransferMode.PULL, tid), 1))
    ).json()
    response = await d_client.post(
        "/v1/completions",
        json={**leg(pull_decode_leg_params(first["kv_transfer_params"], tid), 500), "stream": True},
    )
    await response.content.readline()
    response.close()

    assert await eventually(lambda: decode.pool.free_blocks == 64, within_s=1.0)
    generated = (await metrics(d_client))["pd_mock_generation_tokens_total"]
    await asyncio.sleep(0.1)
    assert (await metrics(d_client))["pd_mock_generation_tokens_total"] == generated < 500


async def test_a_prefill_leg_whose_client_gives_up_mid_prefill_frees_its_blocks_and_exports_nothing(pair):
    # a second for the 50-token prompt
    p_client, prefill = await pair(EngineRole.PREFILL, "p0", prefill_s=0.02)
    body = leg(prefill_leg_params(TransferMode.PULL, mint_transfer_id()), 1)
    with pytest.raises(TimeoutError):
        await p_client.post("/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.2))

    assert await eventually(lambda: prefill.pool.free_blocks == 64, within_s=1.0)
    assert (await metrics(p_client))["pd_mock_kv_blocks_held_for_transfer"] == 0


def test_coordinates_name_the_side_channel():
    pool = KVPool(8, 16)
    mover = create_mover("mock", pool=pool, engine_id="p9", host="127.0.0.1", side_channel_port=0, lease_s=1)
    try:
        coordinates = mover.side_channel()
        assert (
            isinstance(coordinates, PrefillCoordinates)
            and coordinates.engine_id == "p9"
            and coordinates.side_channel_port > 0
        )
    finally:
        asyncio.run(mover.close())
