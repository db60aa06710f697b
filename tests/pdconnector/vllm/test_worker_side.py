"""The connector's worker side between vLLM's steps: a step that runs no request waits for a transfer to end
instead of handing vLLM an empty answer at once, and stops waiting the moment one ends."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from pdconnector.layout import RankLayout
from pdconnector.transport.base import Device, MemoryRegion
from pdconnector.vllm.config import parse_connector_config
from pdconnector.vllm.metadata import PDConnectorMetadata
from pdconnector.vllm.worker import WorkerSide
from pdconnector.worker.commands import PrefillDone

from tests.pdconnector.worker.engines import MODELS

LEASE_S = 0.5


@pytest.fixture
def prefill_rank() -> Iterator[WorkerSide]:
    config = parse_connector_config(
        engine_id="idle-prefill",
        extra={"backends": ["mock"], "side_channel_port": 5999, "lease_s": LEASE_S},
        buffer_device="cpu",
        failure_policy="fail",
        env={},
    )
    layout = RankLayout(MODELS["dense"], 1, 0, 8)
    pools = [np.zeros(region.nbytes, dtype=np.uint8) for region in layout.regions]
    regions = [MemoryRegion(pool.ctypes.data, pool.nbytes, Device.DRAM, 0) for pool in pools]
    side = WorkerSide(config, layout, regions)
    side.start()
    yield side
    side.close()


def step(side: WorkerSide, idle_wait_s: float, *commands: PrefillDone) -> tuple[float, set[str]]:
    """One vLLM step on this rank: its commands, then its results; how long the results took, and the
    requests whose sends ended."""
    side.apply(PDConnectorMetadata(commands=list(commands), idle_wait_s=idle_wait_s))
    started = time.monotonic()
    results = side.results()
    return time.monotonic() - started, results.finished_sending


def test_an_idle_step_returns_as_soon_as_a_transfer_ends_not_at_the_end_of_its_wait(
    prefill_rank: WorkerSide,
) -> None:
    held = PrefillDone("req-1", "tx-idle-1", ((1, 2),), 32, pull=False)
    # Nobody registers for it: prefill's hold ends at its lease, the end this step waits for.
    waited, ended = step(prefill_rank, 30.0, held)
    assert ended == {"req-1"}
    assert LEASE_S * 0.5 < waited < 10.0


def test_a_step_that_runs_requests_never_waits(prefill_rank: WorkerSide) -> None:
    waited, ended = step(prefill_rank, 0.0, PrefillDone("req-2", "tx-idle-2", ((3,),), 16, pull=False))
    assert ended == set() and waited < LEASE_S * 0.5


def test_an_idle_step_with_no_transfer_alive_does_not_wait(prefill_rank: WorkerSide) -> None:
    waited, ended = step(prefill_rank, 30.0)
    assert ended == set() and waited < 5.0
