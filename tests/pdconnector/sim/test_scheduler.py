"""The mock engine's capacity: prefill is a token throughput (one prompt at a time), decode runs at most
max_num_seqs requests with steps that slow as the batch grows, and both report waiting and running requests
as vLLM does."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient
from pdconnector.sim.engine import EngineSettings, MockEngine
from pdconnector.sim.metrics import EngineMetrics
from pdconnector.sim.pool import KVPool, OutOfBlocks
from pdconnector.sim.scheduler import LatencyModel, Scheduler
from pdconnector.sim.server import create_engine_app

from tests.pdconnector.sim.engines import eventually, metrics, serving


async def test_prompts_queue_behind_the_one_being_prefilled() -> None:
    scheduler = Scheduler(LatencyModel(prefill_s_per_token=0.01), max_num_seqs=8)
    prefills = [asyncio.create_task(scheduler.prefill(10)) for _ in range(3)]
    await asyncio.sleep(0.02)
    assert (scheduler.running, scheduler.waiting) == (1, 2)
    done, _ = await asyncio.wait(prefills, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1, "one prompt at a time"
    await asyncio.gather(*prefills)
    assert (scheduler.running, scheduler.waiting) == (0, 0)


async def test_requests_beyond_max_num_seqs_wait_for_a_slot_and_a_cancelled_wait_leaves_no_trace() -> None:
    scheduler = Scheduler(LatencyModel(), max_num_seqs=2)
    release = asyncio.Event()

    async def generate() -> None:
        async with scheduler.generating():
            await release.wait()

    tasks = [asyncio.create_task(generate()) for _ in range(4)]
    await asyncio.sleep(0)
    assert (scheduler.running, scheduler.waiting) == (2, 2)
    tasks[3].cancel()
    await asyncio.sleep(0)
    assert (scheduler.running, scheduler.waiting) == (2, 1)
    release.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert (scheduler.running, scheduler.waiting) == (0, 0)


async def test_a_decode_step_slows_with_every_other_running_request(monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = Scheduler(LatencyModel(decode_s_per_token=0.01, batch_slowdown=0.5), max_num_seqs=8)
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def recorded(seconds: float) -> None:
        slept.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", recorded)
    await scheduler.decode_step()
    scheduler.running = 5
    await scheduler.decode_step()
    assert slept == [pytest.approx(0.01), pytest.approx(0.01 * (1 + 0.5 * 4))]


def test_max_num_seqs_must_admit_a_request() -> None:
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        Scheduler(LatencyModel(), max_num_seqs=0)


async def test_the_engine_exports_vllm_load_gauges_and_time_per_output_token() -> None:
    pool = KVPool(64, 4)
    settings = EngineSettings(
        role=None, engine_id="e0", latency=LatencyModel(decode_s_per_token=0.05), max_num_seqs=1
    )
    engine = MockEngine(settings, pool, None, EngineMetrics(pool))
    client = TestClient(serving(create_engine_app(engine, "tiny", compat_hash="abc")))
    await client.start_server()
    try:
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 5}
        requests = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)]
        assert await eventually(lambda: (engine.scheduler.running, engine.scheduler.waiting) == (1, 1), 5.0)
        samples = await metrics(client)
        assert samples["vllm:num_requests_running"] == 1
        assert samples["vllm:num_requests_waiting"] == 1
        for response in await asyncio.gather(*requests):
            assert response.status == 200
        samples = await metrics(client)
        assert samples["vllm:request_time_per_output_token_seconds_count"] == 2
        # four gaps of one 50 ms step each (the batch is one request): 50 ms per output token
        assert samples["vllm:request_time_per_output_token_seconds_sum"] / 2 >= 0.05
        assert samples["vllm:num_requests_running"] == samples["vllm:num_requests_waiting"] == 0
    finally:
        await client.close()


async def test_a_request_that_finds_the_pool_full_waits_for_blocks_and_gets_them_once_freed() -> None:
    pool = KVPool(4, 4)
    scheduler = Scheduler(LatencyModel(), max_num_seqs=8, kv_wait_s=5.0)
    pool.on_free = scheduler.blocks_freed
    held = await scheduler.allocate(pool, 16)  # the whole pool
    waiter = asyncio.create_task(scheduler.allocate(pool, 8))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    assert scheduler.waiting == 1
    pool.free(held)
    assert len(await asyncio.wait_for(waiter, 1.0)) == 2
    assert scheduler.waiting == 0


async def test_a_wait_for_blocks_ends_at_its_deadline_and_a_request_larger_than_the_pool_at_once() -> None:
    pool = KVPool(4, 4)
    scheduler = Scheduler(LatencyModel(), max_num_seqs=8, kv_wait_s=0.05)
    await scheduler.allocate(pool, 16)
    with pytest.raises(OutOfBlocks):
        await scheduler.allocate(pool, 4)
    assert scheduler.waiting == 0
    patient = Scheduler(LatencyModel(), max_num_seqs=8, kv_wait_s=60.0)
    with pytest.raises(OutOfBlocks):
        await asyncio.wait_for(patient.allocate(KVPool(4, 4), 17), 1.0)
