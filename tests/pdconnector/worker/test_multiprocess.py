"""Byte-exact transfers between engine processes: a prefill process and a decode process, each hosting its TP
ranks as threads (one worker and one transport per rank), over real NIXL (UCX, host memory) and over
MockTransport.

Matrix (the full TP x layout matrix runs in-process in test_transfers.py): NIXL: dense and hybrid Mamba2 (DS)
at P1xD1, P1xD2, P2xD1, P2xD4, and a staged Mamba2 push at P2xD4; mock: dense P2xD4, Mamba2 P1xD2, GDN P4xD2,
Mamba1 P2xD2. Each case: push with the registration first, push with the prefill first, then pull. Then, over
NIXL: a killed peer process on either side, and the idle CPU of engine processes holding NIXL agents.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from pdconnector.transport.nixl_transport import nixl_unavailable_reason

from tests.pdconnector.worker.engines import MODELS, EngineHost, RemoteEngine, request_blocks, warm_hosts
from tests.pdconnector.worker.scenarios import Pair, push_both_orders, push_then_pull

NIXL_CASES = [
    *(("nixl", model, p, d) for model in ("dense", "mamba2") for p, d in ((1, 1), (1, 2), (2, 1), (2, 4))),
    ("nixl", "dense_two_heads", 4, 1),  # replicated heads: two of the four writers only notify
]
MOCK_CASES = [
    ("mock", "dense", 2, 4),
    ("mock", "mamba2", 1, 2),
    ("mock", "gdn", 4, 2),
    ("mock", "mamba1", 2, 2),
]
BLOCKS = (32, 48)
# A killed peer's transfer ends soon after its deadline (decode: the side-channel probe finds the writer
# gone, then a 1 s grace; prefill: its WRITE fails, at worst at the write timeout): the slack leaves room for
# a loaded 2-core machine and stays far below what it tells apart, a transfer held for its whole fence or
# lease (30 s and more).
PEER_KILLED_SLACK_S = 10.0


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[EngineHost, EngineHost]]:
    with warm_hosts() as both:
        yield both


CASES = NIXL_CASES + MOCK_CASES


@pytest.mark.parametrize(
    ("transport", "model", "p_tp", "d_tp"), CASES, ids=[f"{t}-{m}-P{p}-D{d}" for t, m, p, d in CASES]
)
def test_engine_processes_move_every_byte_by_push_and_pull(
    hosts: tuple[EngineHost, EngineHost], transport: str, model: str, p_tp: int, d_tp: int
) -> None:
    if transport == "nixl" and (reason := nixl_unavailable_reason()) is not None:
        pytest.fail(f"NIXL must be importable here: {reason}")
    tag = f"{transport}-{model}-{p_tp}{d_tp}"
    prefill = hosts[0].create(f"prefill-{tag}", model, tp=p_tp, num_blocks=BLOCKS[0], transport=transport)
    decode = hosts[1].create(f"decode-{tag}", model, tp=d_tp, num_blocks=BLOCKS[1], transport=transport)
    try:
        coords = prefill.start()
        decode.start()
        pair = Pair(prefill, decode, coords, model, (p_tp, d_tp), BLOCKS)
        push_then_pull(pair)
    finally:
        decode.close()
        prefill.close()


def test_engine_processes_stage_a_push_over_nixl_into_the_slot_decode_offered(
    hosts: tuple[EngineHost, EngineHost],
) -> None:
    """Prefill gathers into its registered staging buffer, one WRITE per rank crosses NIXL into the slot
    decode offered, decode scatters: the same bytes as the direct path, one descriptor per WRITE."""
    if (reason := nixl_unavailable_reason()) is not None:
        pytest.fail(f"NIXL must be importable here: {reason}")
    staging = {"nbytes": 1 << 22, "path": "staged"}
    prefill = hosts[0].create(
        "prefill-staged", "mamba2", tp=2, num_blocks=BLOCKS[0], transport="nixl", staging=staging
    )
    decode = hosts[1].create(
        "decode-staged", "mamba2", tp=4, num_blocks=BLOCKS[1], transport="nixl", staging=staging
    )
    try:
        coords = prefill.start()
        decode.start()
        push_both_orders(Pair(prefill, decode, coords, "mamba2", (2, 4), BLOCKS))
        stats = prefill.stats()
        assert [s["writes_staged"] for s in stats] == [s["writes_posted"] for s in stats] == [4, 4]
        assert all(s["staging_slots_free"] == 2 for s in decode.stats())
    finally:
        decode.close()
        prefill.close()


def _push_setup(
    prefill: RemoteEngine,
    decode: RemoteEngine,
    transfer_id: str,
    timeout_s: float,
    *,
    model: str = "dense",
    blocks: tuple[int, int] = BLOCKS,
) -> tuple[list[list[int]], list[list[int]], int, float]:
    """Start both engines and have decode register a push; returns prefill's and decode's blocks, the token
    count and when decode was asked. The request fills all but 16 of the smaller pool, so a WRITE's size
    follows the pools'."""
    spec = MODELS[model]
    num_tokens = spec.block_size * (min(blocks) - 16) + 1
    src = request_blocks(spec, blocks[0], num_tokens, seed=21)
    dst = request_blocks(spec, blocks[1], num_tokens, seed=22)
    coords = prefill.start()
    decode.start()
    prefill.fill(blocks=src, num_tokens=num_tokens)
    asked = time.monotonic()
    decode.expect_push(
        transfer_id=transfer_id, prefill=coords, blocks=dst, num_tokens=num_tokens, timeout_s=timeout_s
    )
    return src, dst, num_tokens, asked


def test_decode_fails_within_its_deadline_when_the_prefill_process_is_killed(
    hosts: tuple[EngineHost, EngineHost],
) -> None:
    victim = EngineHost()
    victim.warm_nixl()
    decode = hosts[1].create("decode-survivor", "dense", tp=1, num_blocks=BLOCKS[1], transport="nixl")
    try:
        prefill = victim.create("prefill-victim", "dense", tp=2, num_blocks=BLOCKS[0], transport="nixl")
        _, _, _, asked = _push_setup(prefill, decode, "tx-victim-p", timeout_s=4.0)
        assert prefill.wait_stat(name="registrations_received", value=1, timeout_s=10)
        victim.kill()
        results = decode.wait(transfer_id="tx-victim-p", timeout_s=20)
        assert [(r["kind"], r["outcome"]) for r in results] == [("failed_recving", "timeout")], results
        assert time.monotonic() - asked < 4.0 + PEER_KILLED_SLACK_S
        assert decode.check(received=[]) == {"wrong_bytes": 0, "guard_bytes": 0}
    finally:
        decode.close()
        victim.kill()


def test_prefill_frees_its_blocks_promptly_when_the_decode_process_is_killed(
    hosts: tuple[EngineHost, EngineHost],
) -> None:
    victim = EngineHost()
    victim.warm_nixl()
    prefill = hosts[0].create(
        "prefill-survivor",
        "dense",
        tp=1,
        num_blocks=BLOCKS[0],
        transport="nixl",
        limits={"write_timeout_s": 3.0},
    )
    try:
        decode = victim.create("decode-victim", "dense", tp=2, num_blocks=BLOCKS[1], transport="nixl")
        src, _, num_tokens, _ = _push_setup(prefill, decode, "tx-victim-d", timeout_s=30.0)
        assert prefill.wait_stat(name="registrations_received", value=2, timeout_s=10)
        victim.kill()
        prefill.prefill_finished(transfer_id="tx-victim-d", blocks=src, num_tokens=num_tokens)
        start = time.monotonic()
        results = prefill.wait(transfer_id="tx-victim-d", timeout_s=20)
        assert [(r["kind"], r["outcome"]) for r in results] == [("finished_sending", "failed")], results
        assert time.monotonic() - start < 3.0 + PEER_KILLED_SLACK_S  # at worst the write timeout
    finally:
        prefill.close()
        victim.kill()


# Mid-WRITE kills over MockTransport: a WRITE of ~100 MiB cannot fit the loopback socket buffers (32 MiB
# receive, 4 MiB send at most), so while the decode process is frozen the WRITE is provably in flight: prefill
# has posted it (writes_posted) and it has not ended (no result). NIXL over host memory copies by CMA without
# the target's help, so freezing a peer cannot hold a NIXL WRITE open; its killed-peer tests above kill around
# the WRITE.
LARGE_BLOCKS = (416, 416)


def _assert_write_in_flight(prefill: RemoteEngine, transfer_id: str) -> None:
    assert prefill.wait_stat(name="writes_posted", value=1, timeout_s=10)
    time.sleep(0.3)  # let the stream fill the socket buffers
    assert prefill.wait(transfer_id=transfer_id, timeout_s=0) == [], (
        "the WRITE should still be streaming into the frozen decode"
    )


def test_prefill_fails_the_transfer_at_once_when_the_decode_process_dies_mid_write(
    hosts: tuple[EngineHost, EngineHost],
) -> None:
    victim = EngineHost()
    limits = {"write_timeout_s": 30.0}
    prefill = hosts[0].create(
        "prefill-midwrite", "dense_large", tp=1, num_blocks=LARGE_BLOCKS[0], transport="mock", limits=limits
    )
    try:
        decode = victim.create(
            "decode-midwrite", "dense_large", tp=1, num_blocks=LARGE_BLOCKS[1], transport="mock"
        )
        src, _, num_tokens, _ = _push_setup(
            prefill, decode, "tx-midwrite-d", timeout_s=60.0, model="dense_large", blocks=LARGE_BLOCKS
        )
        assert prefill.wait_stat(name="registrations_received", value=1, timeout_s=10)
        victim.pause()
        prefill.prefill_finished(transfer_id="tx-midwrite-d", blocks=src, num_tokens=num_tokens)
        _assert_write_in_flight(prefill, "tx-midwrite-d")
        victim.kill()
        killed = time.monotonic()
        results = prefill.wait(transfer_id="tx-midwrite-d", timeout_s=40)
        assert [(r["kind"], r["outcome"]) for r in results] == [("finished_sending", "failed")], results
        assert time.monotonic() - killed < 3.0, (
            "the broken connection ends the WRITE, long before its 30 s timeout"
        )
    finally:
        prefill.close()
        victim.kill()


def test_decode_keeps_a_partial_write_inside_its_blocks_and_fails_at_its_deadline_when_prefill_dies(
    hosts: tuple[EngineHost, EngineHost],
) -> None:
    victim = EngineHost()
    decode_host = EngineHost()
    try:
        prefill = victim.create(
            "prefill-midwrite", "dense_large", tp=1, num_blocks=LARGE_BLOCKS[0], transport="mock"
        )
        decode = decode_host.create(
            "decode-midwrite", "dense_large", tp=1, num_blocks=LARGE_BLOCKS[1], transport="mock"
        )
        src, dst, num_tokens, asked = _push_setup(
            prefill, decode, "tx-midwrite-p", timeout_s=6.0, model="dense_large", blocks=LARGE_BLOCKS
        )
        whole = [{"dst": dst, "src": src, "num_tokens": num_tokens}]
        request_bytes = decode.check(received=whole)["wrong_bytes"]
        assert prefill.wait_stat(name="registrations_received", value=1, timeout_s=10)
        decode_host.pause()
        try:
            prefill.prefill_finished(transfer_id="tx-midwrite-p", blocks=src, num_tokens=num_tokens)
            _assert_write_in_flight(prefill, "tx-midwrite-p")
            victim.kill()
        finally:
            decode_host.resume()
        results = decode.wait(transfer_id="tx-midwrite-p", timeout_s=20)
        assert [(r["kind"], r["outcome"]) for r in results] == [("failed_recving", "timeout")], results
        assert time.monotonic() - asked < 6.0 + PEER_KILLED_SLACK_S
        # Every byte of the request's blocks is either written with prefill's content or untouched, and
        # nothing else changed: written + missing add up to the request, the guards are intact, and the write
        # stopped part-way.
        written, missing = decode.check(received=[]), decode.check(received=whole)
        assert written["wrong_bytes"] + missing["wrong_bytes"] == request_bytes, (
            written,
            missing,
            request_bytes,
        )
        assert 0 < written["wrong_bytes"] < request_bytes
        assert written["guard_bytes"] == 0
    finally:
        victim.kill()
        decode_host.stop()


def test_idle_engine_processes_with_nixl_agents_burn_almost_no_cpu(
    hosts: tuple[EngineHost, EngineHost],
) -> None:
    prefill = hosts[0].create("prefill-idle", "mamba2", tp=2, num_blocks=BLOCKS[0], transport="nixl")
    decode = hosts[1].create("decode-idle", "mamba2", tp=2, num_blocks=BLOCKS[1], transport="nixl")
    try:
        coords = prefill.start()
        decode.start()
        push_both_orders(Pair(prefill, decode, coords, "mamba2", (2, 2), BLOCKS))
        # Both processes idle at once, each measuring its own CPU time over 5 s (NIXL's busy progress thread
        # would cost ~5 s each): an idle engine of two ranks stays under 2% of a core (measured here: ~0.9%).
        with ThreadPoolExecutor(2) as pool:
            cpu = list(pool.map(lambda engine: engine.idle_cpu(seconds=5.0), (prefill, decode)))
        assert max(cpu) < 0.02 * 5.0, cpu
    finally:
        decode.close()
        prefill.close()
