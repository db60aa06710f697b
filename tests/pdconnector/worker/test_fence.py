"""The fence, between engine processes: decode keeps a failed push's blocks while a prefill that may still
write into them is alive, and frees them as soon as it can no longer touch them.

The prefill engine runs in its own process, frozen with SIGSTOP after it took decode's registration (the hard
case: a frozen process neither answers nor disconnects). Decode's deadline passes meanwhile; its result (which
lets the engine reuse the blocks) must wait for the prefill's answer after SIGCONT, or for the fence when no
answer comes, and arrive at once when the prefill process is gone. Over MockTransport and real NIXL (UCX) in
host memory, and over NIXL with both engines' pools in VRAM (the GPU suite: ``pytest -m gpu``; skipped without
CUDA).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from pdconnector.transport.nixl_transport import nixl_unavailable_reason

from tests.pdconnector.worker.engines import MODELS, Engine, EngineHost, RemoteEngine, request_blocks
from tests.pdconnector.worker.vram import gpu_suite

BLOCKS = 32
DEADLINE_S = 1.5
SLACK_S = 1.5  # thread wake-ups and notification round trips on a loaded 2-core machine
SUITE = gpu_suite()
VRAM = pytest.param(
    ("nixl", SUITE.device),
    id="nixl-vram",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(SUITE.skip_reason is not None, reason=SUITE.skip_reason or ""),
    ],
)
MEMORIES = [pytest.param(("mock", None), id="mock"), pytest.param(("nixl", None), id="nixl"), VRAM]


@pytest.fixture(params=MEMORIES)
def memory(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    """(transport, device of both engines' pools: None for numpy host memory)."""
    if request.param[0] == "nixl" and (reason := nixl_unavailable_reason()) is not None:
        pytest.fail(f"NIXL must be importable here: {reason}")
    return request.param


@pytest.fixture
def transport(memory: tuple[str, str | None]) -> str:
    return memory[0]


@pytest.fixture
def prefill_host(transport: str) -> Iterator[EngineHost]:
    host = EngineHost()
    try:
        if transport == "nixl":
            host.warm_nixl()
        yield host
    finally:
        host.resume()
        host.kill()


def _frozen_after_registration(
    prefill_host: EngineHost, memory: tuple[str, str | None], *, fence_s: float
) -> tuple[RemoteEngine, Engine, dict[str, Any], float]:
    """Decode registers a push with a prefill process, which is frozen once it has the registration; returns
    both engines, the request and when decode registered it (its deadline runs from then)."""
    transport, device = memory
    prefill = prefill_host.create(
        "prefill-frozen", "dense", tp=1, num_blocks=BLOCKS, transport=transport, device=device
    )
    decode = Engine(
        "decode-fenced", "dense", tp=1, num_blocks=BLOCKS, transport=transport, fence_s=fence_s, device=device
    )
    coords = prefill.start()
    decode.start()
    spec = MODELS["dense"]
    num_tokens = spec.block_size * 8 + 1
    src, dst = (
        request_blocks(spec, BLOCKS, num_tokens, seed=5),
        request_blocks(spec, BLOCKS, num_tokens, seed=6),
    )
    request = {"src": src, "dst": dst, "num_tokens": num_tokens}
    prefill.fill(blocks=request["src"], num_tokens=num_tokens)
    asked = time.monotonic()
    decode.expect_push(
        "tx-fenced", prefill=coords, blocks=request["dst"], num_tokens=num_tokens, timeout_s=DEADLINE_S
    )
    assert prefill.wait_stat(name="registrations_received", value=1, timeout_s=20)
    prefill_host.pause()
    return prefill, decode, request, asked


def test_decode_holds_the_blocks_past_its_deadline_while_the_prefill_is_frozen_and_frees_them_on_its_answer(
    prefill_host: EngineHost, memory: tuple[str, str | None]
) -> None:
    prefill, decode, request, _ = _frozen_after_registration(prefill_host, memory, fence_s=60.0)
    try:
        # deadline passed: the blocks are still held
        assert decode.wait("tx-fenced", timeout_s=DEADLINE_S + SLACK_S) == []
        assert decode.transfers.workers[0].fenced() == 1
        prefill_host.resume()
        resumed = time.monotonic()
        # Resumed, the prefill has decode's abort: it never writes, answers, and frees its own blocks.
        results = decode.wait("tx-fenced", timeout_s=10)
        assert [(r["kind"], r["outcome"]) for r in results] == [("failed_recving", "timeout")], results
        assert time.monotonic() - resumed < SLACK_S + 1.0
        deadline = time.monotonic() + 1.0
        while (
            decode.transfers.workers[0].fenced() and time.monotonic() < deadline
        ):  # published at the end of the thread's turn
            time.sleep(0.01)
        assert decode.transfers.workers[0].fenced() == 0
        assert decode.stats()[0].get("fences_expired", 0) == 0
        prefill.prefill_finished(
            transfer_id="tx-fenced", blocks=request["src"], num_tokens=request["num_tokens"]
        )
        freed = prefill.wait(transfer_id="tx-fenced", timeout_s=5)
        # Both the abort and the registration's lifetime (decode's time left + the grace) passed while the
        # prefill was frozen; which of the two its transfer thread meets first after SIGCONT is thread order,
        # and either ends the transfer unwritten.
        assert [r["kind"] for r in freed] == ["finished_sending"], freed
        assert freed[0]["outcome"] in ("cancelled", "expired"), freed
        assert prefill.stats()[0].get("writes_posted", 0) == 0
        # nothing landed, before or after
        assert decode.check(received=[]) == {"wrong_bytes": 0, "guard_bytes": 0}
    finally:
        decode.close()


def test_a_prefill_that_never_answers_is_fenced_for_fence_s_after_the_deadline_then_released_and_counted(
    prefill_host: EngineHost, memory: tuple[str, str | None]
) -> None:
    fence_s = 10.0
    _, decode, _, asked = _frozen_after_registration(prefill_host, memory, fence_s=fence_s)
    try:
        # Nothing by midway through the fence (from decode's registration, which the setup's round trips and
        # the freeze follow), then the release at its end.
        midway = asked + DEADLINE_S + fence_s / 2
        assert time.monotonic() < midway - 1.0, "the setup took half the fence: nothing left to check"
        assert decode.wait("tx-fenced", timeout_s=max(0.0, midway - time.monotonic())) == []
        results = decode.wait("tx-fenced", timeout_s=fence_s / 2 + SLACK_S + 1.0)
        assert [(r["kind"], r["outcome"]) for r in results] == [("failed_recving", "timeout")], results
        assert decode.stats()[0]["fences_expired"] == 1
    finally:
        decode.close()


def test_a_prefill_process_that_is_gone_releases_the_fence_at_once(
    prefill_host: EngineHost, memory: tuple[str, str | None]
) -> None:
    _, decode, _, _ = _frozen_after_registration(prefill_host, memory, fence_s=60.0)
    try:
        assert decode.wait("tx-fenced", timeout_s=DEADLINE_S) == []
        # a dead process posts nothing: its side channel refuses, and the fence ends after a grace
        prefill_host.kill()
        killed = time.monotonic()
        results = decode.wait("tx-fenced", timeout_s=15)
        assert [(r["kind"], r["outcome"]) for r in results] == [("failed_recving", "timeout")], results
        # the probe: a side-channel lookup that may run into its own timeout
        assert time.monotonic() - killed < SLACK_S + 6.0
    finally:
        decode.close()


def test_a_decode_cancel_is_fenced_the_same_way(
    prefill_host: EngineHost, memory: tuple[str, str | None]
) -> None:
    _, decode, _, _ = _frozen_after_registration(prefill_host, memory, fence_s=60.0)
    try:
        decode.cancel("tx-fenced")
        assert decode.wait("tx-fenced", timeout_s=DEADLINE_S + SLACK_S) == []
        prefill_host.resume()
        results = decode.wait("tx-fenced", timeout_s=10)
        assert [(r["kind"], r["outcome"]) for r in results] == [("failed_recving", "cancelled")], results
    finally:
        decode.close()
