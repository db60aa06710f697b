"""Byte-exact transfers between engine processes: a prefill process and a decode process, each hosting its TP ranks as
threads (one worker and one transport per rank), over real NIXL (UCX, host memory) and over MockTransport.

Matrix (the full TP x layout matrix runs in-process in test_transfers.py):
NIXL: dense and hybrid Mamba2 (DS) at P1xD1, P1xD2, P2xD1, P2xD4; mock: dense P2xD4, Mamba2 P1xD2, GDN P4xD2, Mamba1 P2xD2.
Each case: push with the registration first, push with the prefill first, then pull.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pdconnector.transport.nixl_transport import nixl_unavailable_reason

from tests.pdconnector.worker.engines import EngineHost
from tests.pdconnector.worker.scenarios import Pair, pull, push_both_orders

NIXL_CASES = [("nixl", model, p, d) for model in ("dense", "mamba2") for p, d in ((1, 1), (1, 2), (2, 1), (2, 4))]
MOCK_CASES = [("mock", "dense", 2, 4), ("mock", "mamba2", 1, 2), ("mock", "gdn", 4, 2), ("mock", "mamba1", 2, 2)]
BLOCKS = (32, 48)


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[EngineHost, EngineHost]]:
    prefill, decode = EngineHost(), EngineHost()
    try:
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


CASES = NIXL_CASES + MOCK_CASES


@pytest.mark.parametrize(("transport", "model", "p_tp", "d_tp"), CASES, ids=[f"{t}-{m}-P{p}-D{d}" for t, m, p, d in CASES])
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
        push_both_orders(pair)
        decode.reset()
        pull(pair)
    finally:
        decode.close()
        prefill.close()
