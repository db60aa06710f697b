"""What a decode engine running our connector does when its KV transfer fails, under each
``kv_load_failure_policy``.

``recompute``: the request is computed locally instead; its answer equals the co-located one (token ids and
top-5 logprobs), it arrives within the transfer deadline, and no block stays held on either engine. ``fail``:
the request fails within the transfer deadline and the decode log names the transfer and the reason; prefill
frees the blocks it kept when its lease runs out; both engines keep serving P/D requests.

vLLM reads the policy once per engine (its scheduler's ``recompute_kv_load_failures``), so one decode engine
cannot show both. Rather than a prefill plus two decode engines (three start-ups at ~40-60 s each on this
machine), two ``kv_both`` engines, one per policy, act as prefill for each other: the recompute engine decodes
from the fail engine and the fail engine decodes from the recompute engine. Short transfer timeout and lease
keep the waits brief.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pdconnector.protocol.params import (
    RECEIVED_KEY,
    PrefillCoordinates,
    TransferMode,
    mint_transfer_id,
    prefill_leg_params,
    pull_decode_leg_params,
    push_decode_leg_params,
)

from tests.pdconnector.vllm.harness import (
    LOOPBACK,
    Completion,
    CompletionError,
    complete,
    launch_server,
    output_differences,
    running_servers,
)
from tests.pdconnector.vllm.pd_engines import (
    ENGINE_ENV,
    LOGPROB_ATOL,
    MAX_TOKENS,
    PDPair,
    connector_config,
    kv_cache_usage,
    prompt_of,
    reserve_ports,
    wait_for_free_blocks,
)

pytestmark = pytest.mark.slow

TRANSFER_TIMEOUT_S = 10.0  # decode's deadline for a transfer (registration wait, handshake, READ)
LEASE_S = 10.0  # how long prefill keeps finished blocks for a decode that has not come for them
SLACK_S = 15.0  # engine steps, HTTP and metric refresh on a loaded 2-core machine
NO_BLOCKS_HELD = {"prefill": 0.0, "decode": 0.0}
UNKNOWN_BLOCK_ID = 10**7  # beyond any KV cache of the tiny model


@dataclass(frozen=True)
class CrossedPairs:
    """The same two engines seen as two prefill -> decode pairs."""

    into_recompute: PDPair  # decode: the engine with kv_load_failure_policy recompute
    into_fail: PDPair  # decode: the engine with kv_load_failure_policy fail


def engine_config(engine_id: str, side_channel_port: int, policy: str) -> dict[str, Any]:
    config = connector_config(
        engine_id, "kv_both", side_channel_port, timeout_s=TRANSFER_TIMEOUT_S, policy=policy
    )
    config["kv_connector_extra_config"]["lease_s"] = LEASE_S
    return config


@pytest.fixture(scope="module")
def engines(dense_model: Path, engine_log_dir: Path) -> Iterator[CrossedPairs]:
    recompute_sc, fail_sc, recompute_http, fail_http = reserve_ports(4)
    recompute_id, fail_id = "failures-recompute", "failures-fail"
    recompute = launch_server(
        recompute_id,
        dense_model,
        engine_log_dir,
        kv_transfer_config=engine_config(recompute_id, recompute_sc, "recompute"),
        env=ENGINE_ENV,
        port=recompute_http,
    )
    fail = launch_server(
        fail_id,
        dense_model,
        engine_log_dir,
        kv_transfer_config=engine_config(fail_id, fail_sc, "fail"),
        env=ENGINE_ENV,
        port=fail_http,
    )
    with running_servers(recompute, fail):
        yield CrossedPairs(
            into_recompute=PDPair(fail, recompute, fail_id, fail_sc),
            into_fail=PDPair(recompute, fail, recompute_id, recompute_sc),
        )


# --- recompute policy ---------------------------------------------------------------------------------------


def decode_from_an_unreachable_prefill(pair: PDPair, prompt: list[int]) -> Completion:
    """Push decode leg naming a side channel nobody listens on: the handshake is refused."""
    nowhere = PrefillCoordinates("nobody", LOOPBACK, reserve_ports(1)[0], 1)
    return complete(
        pair.decode.url,
        prompt,
        max_tokens=MAX_TOKENS,
        kv_transfer_params=push_decode_leg_params(mint_transfer_id(), nowhere),
    )


def decode_whose_prefill_leg_never_comes(pair: PDPair, prompt: list[int]) -> Completion:
    """Push decode leg registered at a live prefill that never computes the transfer: decode's deadline runs
    out."""
    return complete(
        pair.decode.url,
        prompt,
        max_tokens=MAX_TOKENS,
        kv_transfer_params=push_decode_leg_params(mint_transfer_id(), pair.coordinates),
    )


def decode_reading_blocks_prefill_does_not_have(pair: PDPair, prompt: list[int]) -> Completion:
    """Pull decode leg after a real prefill leg, with the block ids to read replaced by ids beyond prefill's
    cache."""
    transfer_id = mint_transfer_id()
    prefill = complete(
        pair.prefill.url,
        prompt,
        max_tokens=1,
        kv_transfer_params=prefill_leg_params(TransferMode.PULL, transfer_id),
    )
    assert prefill.kv_transfer_params, "the prefill leg returned no kv_transfer_params"
    held = prefill.kv_transfer_params["remote_block_ids"]
    unreadable = {
        **prefill.kv_transfer_params,
        "remote_block_ids": [[UNKNOWN_BLOCK_ID + i for i in range(len(group))] for group in held],
    }
    return complete(
        pair.decode.url,
        prompt,
        max_tokens=MAX_TOKENS,
        kv_transfer_params=pull_decode_leg_params(unreadable, transfer_id),
    )


FAILED_TRANSFERS: dict[str, Callable[[PDPair, list[int]], Completion]] = {
    "push-unreachable-prefill": decode_from_an_unreachable_prefill,
    "push-prefill-leg-never-comes": decode_whose_prefill_leg_never_comes,
    "pull-unreadable-remote-blocks": decode_reading_blocks_prefill_does_not_have,
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("failed_transfer", FAILED_TRANSFERS.values(), ids=FAILED_TRANSFERS.keys())
def test_with_the_recompute_policy_a_failed_transfer_is_computed_locally_and_equals_the_colocated_output(
    engines: CrossedPairs, failed_transfer: Callable[[PDPair, list[int]], Completion]
) -> None:
    pair = engines.into_recompute
    prompt = prompt_of(300, seed=40)
    colocated = pair.colocated(prompt, MAX_TOKENS)

    started = time.monotonic()
    recomputed = failed_transfer(pair, prompt)
    elapsed = time.monotonic() - started

    assert output_differences(colocated, recomputed, logprob_atol=LOGPROB_ATOL) == []
    assert recomputed.prompt_token_ids == prompt
    assert RECEIVED_KEY not in (recomputed.kv_transfer_params or {}), "decode claims a transfer that failed"
    assert elapsed < TRANSFER_TIMEOUT_S + SLACK_S
    assert wait_for_free_blocks(pair, timeout_s=LEASE_S + SLACK_S) == NO_BLOCKS_HELD


# --- fail policy: the two legs name different transfers -----------------------------------------------------


@pytest.mark.timeout(300)
def test_a_push_whose_legs_name_different_transfers_fails_decode_in_time_and_prefill_frees_at_lease(
    engines: CrossedPairs,
) -> None:
    pair = engines.into_fail
    prompt = prompt_of(300, seed=41)
    registered, computed = mint_transfer_id(), mint_transfer_id()
    log_offset = pair.decode.log_path.stat().st_size

    with ThreadPoolExecutor(max_workers=1) as pool:
        decode_started = time.monotonic()
        decode = pool.submit(
            complete,
            pair.decode.url,
            prompt,
            max_tokens=MAX_TOKENS,
            kv_transfer_params=push_decode_leg_params(registered, pair.coordinates),
        )
        prefill = complete(
            pair.prefill.url,
            prompt,
            max_tokens=1,
            kv_transfer_params=prefill_leg_params(TransferMode.PUSH, computed),
        )
        prefill_finished = time.monotonic()
        held_after_prefill = kv_cache_usage(pair.prefill)
        with pytest.raises(CompletionError) as failure:
            decode.result()
        decode_failed_after = time.monotonic() - decode_started

    assert prefill.token_ids, "the prefill leg itself succeeds"
    assert held_after_prefill > 0, "prefill keeps the computed blocks for a decode"
    assert failure.value.status is not None and failure.value.status >= 500, failure.value
    assert decode_failed_after < TRANSFER_TIMEOUT_S + SLACK_S
    decode_log = pair.decode.log_path.read_bytes()[log_offset:].decode(errors="replace")
    reasons = [line for line in decode_log.splitlines() if registered in line and "failed" in line]
    assert reasons, f"the decode log does not say why transfer {registered} failed:\n{decode_log[-3000:]}"

    assert wait_for_free_blocks(pair, timeout_s=LEASE_S + SLACK_S) == NO_BLOCKS_HELD
    assert time.monotonic() - prefill_finished < LEASE_S + SLACK_S

    # Both engines keep serving P/D traffic, in both directions.
    for healthy in (engines.into_fail, engines.into_recompute):
        result = healthy.push(prompt, MAX_TOKENS)
        assert (
            output_differences(
                healthy.colocated(prompt, MAX_TOKENS), result.decode, logprob_atol=LOGPROB_ATOL
            )
            == []
        )
        assert (result.decode.kv_transfer_params or {}).get(RECEIVED_KEY), result.decode.kv_transfer_params
    assert wait_for_free_blocks(pair, timeout_s=LEASE_S + SLACK_S) == NO_BLOCKS_HELD
