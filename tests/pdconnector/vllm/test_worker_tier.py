"""The KV tier on a worker rank between vLLM's steps: prefill's save waits for the end of the request's
transfer and is reported with it; a load that fails is reported to vLLM as load errors (prefill computes those
blocks again); a save that fails still frees the request's blocks and is reported to the scheduler side, which
then never makes its slots readable."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from pdconnector.layout import RankLayout
from pdconnector.tier.store import RankTier, TierStore
from pdconnector.transport.base import Device, MemoryRegion
from pdconnector.vllm.config import parse_connector_config
from pdconnector.vllm.metadata import Command, LoadFromTier, PDConnectorMetadata, SaveToTier, TierFailures
from pdconnector.vllm.worker import TransferResults, WorkerSide
from pdconnector.worker.commands import PrefillDone

from tests.pdconnector.worker.engines import MODELS

LEASE_S = 0.5
SLOTS = 4


@pytest.fixture
def rank() -> Iterator[tuple[WorkerSide, list[np.ndarray], RankTier]]:
    """A prefill rank of the dense model (3 regions of 8 blocks in host memory) with a 4-slot tier."""
    config = parse_connector_config(
        engine_id="tier-prefill",
        extra={"backends": ["mock"], "side_channel_port": 5998, "lease_s": LEASE_S, "tier_bytes": 1 << 20},
        buffer_device="cpu",
        failure_policy="fail",
        env={},
    )
    layout = RankLayout(MODELS["dense"], 1, 0, 8)
    rng = np.random.default_rng(7)
    pools = [rng.integers(0, 255, region.nbytes, dtype=np.uint8) for region in layout.regions]
    regions = [MemoryRegion(pool.ctypes.data, pool.nbytes, Device.DRAM, 0) for pool in pools]
    tier = RankTier(TierStore(layout.regions, SLOTS), [torch.from_numpy(pool) for pool in pools])
    side = WorkerSide(config, layout, regions, tier)
    side.start()
    yield side, pools, tier
    side.close()


def step(side: WorkerSide, *commands: Command, idle_wait_s: float = 0.0) -> TransferResults:
    side.apply(PDConnectorMetadata(commands=list(commands), idle_wait_s=idle_wait_s))
    return side.results()


def block(pools: list[np.ndarray], block_id: int, stride: int = 2048) -> bytes:
    return b"".join(pool[block_id * stride : (block_id + 1) * stride].tobytes() for pool in pools)


def test_prefill_saves_a_request_once_its_kv_left_and_reports_both_together(rank) -> None:
    side, pools, tier = rank
    tier.store.buffer.zero_()
    save = SaveToTier("req-1", (2, 5), (0, 3), after_send=True)
    held = PrefillDone("req-1", "tx-1", ((2, 5),), 32, pull=False)
    assert step(side, save, held).finished_sending == set()  # the transfer holds the blocks: nothing copied
    assert not tier.store.buffer[0].any()
    # nobody registers: the transfer ends at its lease, and the save runs then
    assert step(side, idle_wait_s=30.0).finished_sending == {"req-1"}
    assert tier.store.buffer[0].numpy().tobytes() == block(pools, 2)
    assert tier.store.buffer[3].numpy().tobytes() == block(pools, 5)
    assert side.take_tier_failures() is None


def test_a_prefill_load_that_fails_is_reported_as_load_errors_of_its_blocks(rank) -> None:
    side, pools, _ = rank
    before = block(pools, 1)
    results = step(side, LoadFromTier("req-2", (SLOTS + 1, 0), (1, 6)))  # a slot outside the tier
    assert not results.any()
    assert side.take_load_errors() == {1, 6} and side.take_load_errors() == set()
    assert block(pools, 1) == before
    stats = side.take_stats()
    assert stats is not None and stats.data["events"]["tier_loads_failed"] == 1
    assert side.take_tier_failures() == TierFailures(loads={"req-2"})  # the scheduler counts them computed


def test_a_save_that_fails_frees_the_blocks_and_is_reported_to_the_scheduler_side(rank) -> None:
    side, _, _ = rank
    results = step(side, SaveToTier("req-3", (99,), (1,)))  # a block outside the cache
    assert results.finished_sending == {"req-3"}
    assert side.take_tier_failures() == TierFailures(saves={"req-3"})
    assert side.take_tier_failures() is None


def test_a_load_copies_the_saved_bytes_into_other_blocks(rank) -> None:
    side, pools, _ = rank
    saved = block(pools, 4)
    assert step(side, SaveToTier("req-4", (4,), (2,))).finished_sending == {"req-4"}
    step(side, LoadFromTier("req-5", (2,), (7,)))
    assert block(pools, 7) == saved and side.take_load_errors() == set()


def test_the_ranks_tier_failures_reach_the_scheduler_side_as_one_report() -> None:
    # vLLM aggregates the worker metadata of every rank of a step
    one, other = TierFailures(saves={"a"}), TierFailures(loads={"b"}, saves={"c"})
    assert one.aggregate(other) == TierFailures(saves={"a", "c"}, loads={"b"})
    assert not TierFailures() and TierFailures(loads={"b"})
