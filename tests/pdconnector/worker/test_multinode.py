"""Engines larger than a node over real NIXL (UCX, host memory): each node of a multi-node engine is its own
engine process on its own loopback address, and the first node's side channel serves every rank
(:mod:`tests.pdconnector.worker.nodes`).

A single-node prefill pushes to and is pulled by a decode engine spanning two nodes, and the reverse, at
heterogeneous TP (2 -> 4 and 4 -> 2), dense and hybrid Mamba2: every decode byte as expected, every rank on
both sides ends the transfer once. Ranks on the second node are reached at that node's address: with the
idle poll at 10 s, only a ring at the right address wakes a second-node prefill rank for a registration.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from pdconnector.protocol.params import PrefillCoordinates
from pdconnector.transport.nixl_transport import nixl_unavailable_reason
from pdconnector.worker.side_channel import fetch_engine_info

from tests.pdconnector.worker.engines import MODELS, EngineHost, RemoteEngine, request_blocks
from tests.pdconnector.worker.nodes import NODE_HOSTS, SpanningEngine, one_side_spanning, spanning_engine
from tests.pdconnector.worker.scenarios import Pair, assert_received, assert_sent, push_then_pull

BLOCKS = (32, 48)
SPANNING = "spanning"  # the side whose engine spans two nodes


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[EngineHost, EngineHost, EngineHost]]:
    """Three engine processes: one for the single-node engine, one per node of the spanning engine."""
    if (reason := nixl_unavailable_reason()) is not None:
        pytest.fail(f"NIXL must be importable here: {reason}")
    processes = (EngineHost(), EngineHost(), EngineHost())
    try:
        with ThreadPoolExecutor(len(processes)) as pool:
            list(pool.map(EngineHost.warm_nixl, processes))
        yield processes
    finally:
        for process in processes:
            process.stop()


def _engines(
    hosts: tuple[EngineHost, EngineHost, EngineHost],
    tag: str,
    model: str,
    tps: tuple[int, int],
    spanning: str,
    **options: object,
) -> tuple[RemoteEngine | SpanningEngine, RemoteEngine | SpanningEngine]:
    return one_side_spanning(
        hosts[0],
        hosts[1:],
        tag,
        model,
        tps=tps,
        blocks=BLOCKS,
        spanning=spanning,
        transport="nixl",
        **options,
    )


CASES = [
    (model, tps, spanning)
    for model in ("dense", "mamba2")
    for tps, spanning in (((2, 4), "decode"), ((4, 2), "prefill"))
]


@pytest.mark.parametrize(
    ("model", "tps", "spanning"), CASES, ids=[f"{m}-P{p}-D{d}-{s}-on-2-nodes" for m, (p, d), s in CASES]
)
def test_a_single_node_engine_and_one_spanning_two_nodes_move_every_byte_by_push_and_pull(
    hosts: tuple[EngineHost, EngineHost, EngineHost], model: str, tps: tuple[int, int], spanning: str
) -> None:
    prefill, decode = _engines(hosts, f"{model}-{tps[0]}{tps[1]}", model, tps, spanning)
    try:
        coords = prefill.start()
        decode.start()
        push_then_pull(Pair(prefill, decode, coords, model, tps, BLOCKS))
        assert all(s["finished_sending"] == s["prefills_finished"] for s in prefill.stats())
        assert [s.get("failed_recving", 0) for s in decode.stats()] == [0] * tps[1]
    finally:
        decode.close()
        prefill.close()


def test_the_first_nodes_side_channel_serves_every_rank_with_its_node_and_local_device(
    hosts: tuple[EngineHost, EngineHost, EngineHost],
) -> None:
    engine = spanning_engine(
        (hosts[1], hosts[2]),
        "decode-served",
        "dense",
        tp=4,
        num_blocks=16,
        transport="nixl",
        first_device_id=3,
    )
    try:
        coords = PrefillCoordinates(**engine.start())
        assert coords.host == NODE_HOSTS[0]
        info = fetch_engine_info(coords.host, coords.side_channel_port, timeout_s=5)
        assert [(r.tp_rank, r.host, r.device_id) for r in info.ranks] == [
            (0, NODE_HOSTS[0], 3),
            (1, NODE_HOSTS[0], 4),
            (2, NODE_HOSTS[1], 3),
            (3, NODE_HOSTS[1], 4),
        ]
        assert len({r.agent_name for r in info.ranks}) == 4
    finally:
        engine.close()


IDLE_POLL_S = 10.0
PROMPT_BOUND_S = 5.0  # a ring costs a datagram and a wake-up (ms); the idle poll would take 10 s: midway


def test_prefill_ranks_on_the_second_node_are_rung_at_that_nodes_address(
    hosts: tuple[EngineHost, EngineHost, EngineHost],
) -> None:
    """Prefill holds the request's blocks and sleeps on a 10 s idle poll: decode's registration must wake
    every prefill rank, the second node's at 127.0.0.2 (pull needs no ring to free: prefill polls while it
    holds blocks for a READ)."""
    options = {"worker_options": {"idle_poll_max_s": IDLE_POLL_S}}
    prefill, decode = _engines(hosts, "bell", "dense", (2, 1), "prefill", **options)
    try:
        coords = prefill.start()
        decode.start()
        decode.prewarm(prefill=coords)  # the handshake is done: what follows is notifications and rings
        spec = MODELS["dense"]
        num_tokens = spec.block_size * 3 + 1
        src = request_blocks(spec, BLOCKS[0], num_tokens, seed=5)
        dst = request_blocks(spec, BLOCKS[1], num_tokens, seed=6)
        prefill.fill(blocks=src, num_tokens=num_tokens)
        prefill.prefill_finished(transfer_id="tx-bell", blocks=src, num_tokens=num_tokens)
        time.sleep(0.3)  # every rank's thread has gone idle on its 10 s wait
        started = time.monotonic()
        decode.expect_push(
            transfer_id="tx-bell", prefill=coords, blocks=dst, num_tokens=num_tokens, timeout_s=30
        )
        assert_received(decode, "tx-bell", 1, timeout_s=IDLE_POLL_S)
        sent = assert_sent(prefill, "tx-bell", 2, timeout_s=IDLE_POLL_S)
        elapsed = time.monotonic() - started
        assert elapsed < PROMPT_BOUND_S, (
            f"prefill's ranks freed {elapsed:.2f} s after decode registered: {sent}"
        )
        assert decode.check(received=[{"src": src, "dst": dst, "num_tokens": num_tokens}]) == {
            "wrong_bytes": 0,
            "guard_bytes": 0,
        }
    finally:
        decode.close()
        prefill.close()
