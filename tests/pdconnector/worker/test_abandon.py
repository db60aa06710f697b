"""A decode request that ends before it registers or reads anything still releases prefill at once, not at its
lease."""

from __future__ import annotations

import time

import pytest

from tests.pdconnector.worker.engines import MODELS, Engine, request_blocks

LEASE_S = 30.0  # what prefill would otherwise hold the blocks for
PROMPT_TOKENS = 40


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("pull", [False, True], ids=["push", "pull"])
def test_an_abandoned_transfer_frees_every_prefill_rank_on_the_notice_not_at_the_lease(
    p_tp: int, d_tp: int, pull: bool
) -> None:
    limits = {"registration_lease_s": LEASE_S, "prefill_lease_s": LEASE_S}
    prefill = Engine("prefill-0", "dense", tp=p_tp, num_blocks=24, transport="mock", limits=limits)
    decode = Engine("decode-0", "dense", tp=d_tp, num_blocks=24, transport="mock", limits=limits)
    try:
        coords = prefill.start()
        decode.start()
        blocks = request_blocks(MODELS["dense"], 24, PROMPT_TOKENS, seed=3)
        prefill.prefill_finished(transfer_id="tx-gone", blocks=blocks, num_tokens=PROMPT_TOKENS, pull=pull)
        started = time.monotonic()
        decode.abandon("tx-gone", prefill=coords)
        results = prefill.wait(transfer_id="tx-gone", timeout_s=LEASE_S / 2)
        elapsed = time.monotonic() - started
        assert sorted((r["rank"], r["kind"]) for r in results) == [
            (rank, "finished_sending") for rank in range(p_tp)
        ], results
        assert all(r["outcome"] != "expired" for r in results), results
        assert elapsed < LEASE_S / 2  # freed on the notice, not at the lease
        # nothing waited for it on decode: nothing to report
        assert decode.wait(transfer_id="tx-gone", timeout_s=0.2) == []
    finally:
        decode.close()
        prefill.close()
