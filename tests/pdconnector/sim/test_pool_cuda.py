"""KV pools in GPU memory: byte-exact pages, VRAM regions on the rank's device, and KV moved between engines
by NIXL."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from pdconnector.protocol.params import (
    EngineRole,
    TransferMode,
    mint_transfer_id,
    prefill_leg_params,
    pull_decode_leg_params,
    push_decode_leg_params,
)
from pdconnector.sim.cluster import LocalCluster
from pdconnector.sim.model import prefill, reference_tokens, tokenize
from pdconnector.sim.movers import mover_unavailable_reason
from pdconnector.sim.pool import KVDevice, KVPool
from pdconnector.sim.worker_mover import memory_regions
from pdconnector.transport.base import Device

from tests.pdconnector.sim.engines import MODEL, PROMPT, engine_servers, leg

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_pages_round_trip_byte_exactly_through_gpu_memory():
    pool = KVPool(num_blocks=32, block_size=16, device=KVDevice.CUDA)
    pages = np.random.default_rng(7).integers(0, 256, (3, pool.layouts[0].page_bytes), dtype=np.uint8)
    pool.write_pages(0, 1, [30, 4, 17], pages)
    assert (pool.read_pages(0, 1, [30, 4, 17]) == pages).all()
    assert (pool.read_pages(0, 1, [4]) == pages[1:2]).all()
    assert not pool.read_pages(0, 0, range(32)).any()  # the other region was not touched


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_gpu_pool_holds_the_same_kv_as_a_host_pool(tp_size):
    host, gpu = KVPool(16, 16, tp_size), KVPool(16, 16, tp_size, device=KVDevice.CUDA)
    for pool in (host, gpu):
        pool.allocate(20)  # other requests' blocks come first
        prefill(pool, pool.allocate(len(PROMPT)), PROMPT)
    blocks = [2, 3, 4, 5]
    assert gpu.token_bytes(blocks, len(PROMPT)) == host.token_bytes(blocks, len(PROMPT))


def test_gpu_regions_are_vram_on_the_ranks_device_at_the_tensors_addresses():
    pool = KVPool(num_blocks=8, block_size=16, tp_size=2, device=KVDevice.CUDA)
    for rank, (buffers, regions) in enumerate(zip(pool.buffers, memory_regions(pool), strict=True)):
        device = rank % torch.cuda.device_count()
        for buffer, region in zip(buffers, regions, strict=True):
            assert (region.device, region.device_id) == (Device.VRAM, device)
            assert (region.addr, region.nbytes) == (buffer.tensor.data_ptr(), buffer.tensor.numel())
            assert buffer.tensor.device == torch.device("cuda", device)


@pytest.fixture
async def gpu_pair():
    if (reason := mover_unavailable_reason("nixl", KVDevice.CUDA)) is not None:
        pytest.fail(f"NIXL must be able to move GPU memory here: {reason}")
    async with engine_servers("nixl", KVDevice.CUDA) as serve:
        yield serve


async def test_nixl_moves_a_prompts_kv_between_gpu_pools_in_push_and_pull(gpu_pair):
    (p_client, prefill_engine), (d_client, decode_engine) = (
        await gpu_pair(EngineRole.PREFILL, "p0"),
        await gpu_pair(EngineRole.DECODE, "d0"),
    )
    page_bytes = prefill_engine.pool.layouts[0].page_bytes
    for mode in (TransferMode.PUSH, TransferMode.PULL):
        tid = mint_transfer_id()
        if mode is TransferMode.PUSH:
            decode_leg = asyncio.ensure_future(
                d_client.post(
                    "/v1/completions",
                    json=leg(push_decode_leg_params(tid, prefill_engine.mover.side_channel())),
                )
            )
            await p_client.post("/v1/completions", json=leg(prefill_leg_params(mode, tid), 1))
            answer = await (await decode_leg).json()
        else:
            first = await (
                await p_client.post("/v1/completions", json=leg(prefill_leg_params(mode, tid), 1))
            ).json()
            answer = await (
                await d_client.post(
                    "/v1/completions", json=leg(pull_decode_leg_params(first["kv_transfer_params"], tid))
                )
            ).json()
        # The decode engine computed nothing: its tokens come from KV bytes NIXL put into its GPU pool.
        assert answer["choices"][0]["token_ids"] == reference_tokens(PROMPT, 5), mode
        received = answer["kv_transfer_params"]["pd_received"]
        assert received["transfer_id"] == tid and received["bytes"] >= 4 * 2 * page_bytes, mode
    for _ in range(100):
        if prefill_engine.pool.free_blocks == decode_engine.pool.free_blocks == 64:
            break
        await asyncio.sleep(0.05)
    assert prefill_engine.pool.free_blocks == decode_engine.pool.free_blocks == 64


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Engine processes as `pdctl up` runs them (each its own CUDA context), with a router per mode."""
    if (reason := mover_unavailable_reason("nixl", KVDevice.CUDA)) is not None:
        pytest.fail(f"NIXL must be able to move GPU memory here: {reason}")
    args = ["--kv-device", "cuda", "--transfer-timeout", "10", "--lease", "10"]
    cluster = LocalCluster(
        workdir=tmp_path_factory.mktemp("gpu"),
        subnet=180,
        prefill_count=1,
        decode_count=1,
        engine_args=args,
        transport="nixl",
    )
    try:
        cluster.start(colocated=False)
        for mode in ("push", "pull"):
            cluster.start_router(mode, mode)
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_engine_processes_with_gpu_pools_answer_through_the_router_from_moved_kv(
    gpu_cluster: LocalCluster, mode: str
):
    decode = gpu_cluster.engines["decode-0"]
    before = decode.metrics().get("pd_mock_transfer_bytes_total{direction=import}", 0.0)
    prompt = " ".join(f"t{i}" for i in range(40))
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 6}).encode()
    request = urllib.request.Request(
        gpu_cluster.routers[mode].url + "/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        answer, headers = json.loads(response.read()), response.headers
    assert tokenize(answer["choices"][0]["text"]) == reference_tokens(tokenize(prompt), 6)
    assert (headers["x-pd-prefill"], headers["x-pd-decode"]) == ("prefill-0", "decode-0")
    assert decode.metrics()["pd_mock_transfer_bytes_total{direction=import}"] > before
    for engine in gpu_cluster.engines.values():
        with urllib.request.urlopen(engine.url + "/health", timeout=5) as response:
            assert json.loads(response.read())["kv_device"] == "cuda", engine.name
