"""Our connector on real vLLM CPU engines with a dense model over real NIXL (UCX, host memory).

Disaggregated output must equal co-located output: token ids and top-5 logprobs, for push and
pull, for prompts around the block boundary and a long one, one at a time and 16 at once, and into
a decode engine whose prefix cache already holds the start of the prompt; and no block stays held
on either engine afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pdconnector.protocol.params import (
    RECEIVED_KEY,
    PrefillCoordinates,
    TransferMode,
    mint_transfer_id,
    push_decode_leg_params,
)

from tests.pdconnector.vllm.harness import (
    LOOPBACK,
    CompletionError,
    complete,
    metric_sum,
    metric_total,
    output_differences,
    run_concurrently,
    scrape_metrics,
)
from tests.pdconnector.vllm.pd_engines import (
    BATCHED_LOGPROB_ATOL,
    BLOCK_SIZE,
    CONCURRENT,
    CONNECTOR_PATHS,
    DENSE_PATHS,
    LOGPROB_ATOL,
    MAX_TOKENS,
    PROMPT_LENGTHS,
    PDPair,
    assert_disaggregated_equals_colocated,
    kv_cache_usage,
    pd_pair,
    prompt_of,
    reserve_ports,
    wait_for_free_blocks,
)

pytestmark = pytest.mark.slow


# --- decode with vLLM's prefix cache on (its own engine pair, started and stopped before the shared one) ----

SHARED_PREFIX_BLOCKS = 3
SUFFIX_TOKENS = 5


def decode_cache_counters(pair: PDPair) -> dict[str, float]:
    """Prompt tokens the decode engine found in its own prefix cache and tokens it took from prefill (vLLM's
    counters)."""
    return {
        "local": metric_total(pair.decode.url, "vllm:prefix_cache_hits"),
        "transferred": metric_total(pair.decode.url, "vllm:external_prefix_cache_hits"),
    }


@pytest.mark.timeout(900)
def test_a_decode_with_a_cached_prompt_prefix_receives_only_the_blocks_after_it_in_push_and_pull(
    dense_model: Path, engine_log_dir: Path
) -> None:
    """The same 3-block prefix twice, with different 5-token suffixes: the first request moves all 4 blocks,
    the second finds the prefix in decode's cache (put there by the first transfer) and moves only the last
    block. Outputs equal the co-located ones (computed on the prefill engine, whose cache is off, so the
    reference never reads transferred KV)."""
    shared_tokens = SHARED_PREFIX_BLOCKS * BLOCK_SIZE
    with pd_pair("ours-dense-prefix", dense_model, engine_log_dir, decode_prefix_caching=True) as pair:
        for seed, mode in enumerate((TransferMode.PUSH, TransferMode.PULL)):
            shared = prompt_of(shared_tokens, seed=200 + seed)
            moved = []
            for suffix_seed, expected_blocks in ((1, SHARED_PREFIX_BLOCKS + 1), (2, 1)):
                prompt = shared + prompt_of(SUFFIX_TOKENS, seed=10 * seed + suffix_seed)
                before = decode_cache_counters(pair)
                result = pair.run(mode, prompt, MAX_TOKENS)
                after = decode_cache_counters(pair)
                colocated = complete(pair.prefill.url, prompt, max_tokens=MAX_TOKENS)

                assert output_differences(colocated, result.decode, logprob_atol=LOGPROB_ATOL) == [], (
                    f"{mode}, suffix {suffix_seed}"
                )
                received = (result.decode.kv_transfer_params or {}).get(RECEIVED_KEY)
                assert received and received["mode"] == mode.value, result.decode.kv_transfer_params
                assert received["blocks"] == expected_blocks, f"{mode}, suffix {suffix_seed}: {received}"
                moved.append({name: after[name] - before[name] for name in after})
            assert moved == [
                {"local": 0, "transferred": shared_tokens + SUFFIX_TOKENS},
                {"local": shared_tokens, "transferred": SUFFIX_TOKENS},
            ], mode
        assert wait_for_free_blocks(pair) == {"prefill": 0.0, "decode": 0.0}


# --- the shared pair (prefix caching off on both engines) ---------------------------------------------------


@pytest.fixture(scope="module", params=DENSE_PATHS)
def dense_pair(dense_model: Path, engine_log_dir: Path, request: pytest.FixtureRequest) -> Iterator[PDPair]:
    with pd_pair(
        f"ours-dense-{request.param}", dense_model, engine_log_dir, extra=CONNECTOR_PATHS[request.param]
    ) as pair:
        yield pair


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_disaggregated_output_equals_colocated_output_for_every_prompt_length(
    dense_pair: PDPair, mode: TransferMode
) -> None:
    received = assert_disaggregated_equals_colocated(dense_pair, mode, PROMPT_LENGTHS)
    assert {length: report["blocks"] for length, report in received.items()} == {
        n: -(-n // BLOCK_SIZE) for n in PROMPT_LENGTHS
    }
    assert wait_for_free_blocks(dense_pair) == {"prefill": 0.0, "decode": 0.0}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_sixteen_concurrent_requests_match_their_colocated_outputs(
    dense_pair: PDPair, mode: TransferMode
) -> None:
    prompts = [prompt_of(BLOCK_SIZE // 2 + 37 * i, seed=100 + i) for i in range(CONCURRENT)]
    colocated = [dense_pair.colocated(prompt, MAX_TOKENS) for prompt in prompts]

    results = run_concurrently(
        [lambda p=prompt: dense_pair.run(mode, p, MAX_TOKENS, timeout_s=300) for prompt in prompts],
        max_workers=CONCURRENT,
    )

    for prompt, expected, result in zip(prompts, colocated, results, strict=True):
        assert output_differences(expected, result.decode, logprob_atol=BATCHED_LOGPROB_ATOL) == [], (
            f"{mode} prompt of {len(prompt)} tokens"
        )
        assert (result.decode.kv_transfer_params or {}).get(RECEIVED_KEY)
    assert wait_for_free_blocks(dense_pair) == {"prefill": 0.0, "decode": 0.0}


# Layers x (K, V) x KV heads x head dim x tokens x float32 bytes, by hand from the tiny dense model's config.
KV_BYTES_PER_BLOCK = 2 * 2 * 2 * 32 * BLOCK_SIZE * 4


def transfer_counters(pair: PDPair) -> dict[str, float]:
    """The connector's series on both engines' /metrics (one scrape each): transfers ended by direction and
    outcome, bytes, waits."""
    decode, prefill = scrape_metrics(pair.decode.url), scrape_metrics(pair.prefill.url)
    return {
        "decode_received": metric_sum(
            decode, "vllm:pd_kv_transfers", labels={"direction": "recv", "outcome": "received"}
        ),
        "decode_bytes": metric_sum(decode, "vllm:pd_kv_received_bytes"),
        "decode_waits": metric_sum(decode, "vllm:pd_kv_transfer_wait_seconds", labels={"direction": "recv"}),
        "prefill_written": metric_sum(
            prefill, "vllm:pd_kv_transfers", labels={"direction": "send", "outcome": "written"}
        ),
        "prefill_bytes": metric_sum(prefill, "vllm:pd_kv_received_bytes"),
        "prefill_staged": metric_sum(prefill, "vllm:pd_kv_staging_events", labels={"event": "writes_staged"}),
    }


@pytest.mark.timeout(600)
def test_engines_export_each_transfer_its_bytes_and_its_wait_on_their_metrics(dense_pair: PDPair) -> None:
    # Quiet first: KV usage and the connector's stats travel in the same scheduler stats, so no earlier
    # release lands later.
    assert wait_for_free_blocks(dense_pair) == {"prefill": 0.0, "decode": 0.0}
    before = transfer_counters(dense_pair)
    pushed = dense_pair.push(prompt_of(300, seed=41), MAX_TOKENS)
    pulled = dense_pair.pull(prompt_of(BLOCK_SIZE + 1, seed=42), MAX_TOKENS)
    blocks = sum((r.decode.kv_transfer_params or {})[RECEIVED_KEY]["blocks"] for r in (pushed, pulled))
    assert blocks == -(-300 // BLOCK_SIZE) + 2
    want = {
        "decode_received": 2,
        "decode_bytes": blocks * KV_BYTES_PER_BLOCK,
        "prefill_written": 2,
        "prefill_bytes": 0,
        "prefill_staged": 1 if dense_pair.stages_pushes else 0,  # the push; a pull is always read directly
    }
    # prefill's releases reach its /metrics a step or two after decode's answer
    deadline = time.monotonic() + 20
    while True:
        after = transfer_counters(dense_pair)
        delta = {key: after[key] - before[key] for key in want}
        if delta == want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert delta == want
    assert 0 < after["decode_waits"] - before["decode_waits"] < pushed.elapsed_s + pulled.elapsed_s


# --- faults (the pair is shared: the destructive ones come last) --------------------------------------------

TRANSFER_TIMEOUT_S = 30.0  # pd_pair's transfer_timeout_s
DEADLINE_SLACK_S = 20.0


@pytest.mark.timeout(600)
def test_a_push_whose_prefill_leg_never_comes_fails_within_the_deadline_and_frees_its_blocks(
    dense_pair: PDPair,
) -> None:
    """The registration reaches prefill but no prefill ever pairs with it (the router's prefill leg was
    dropped)."""
    prompt = prompt_of(300, seed=7)
    started = time.monotonic()
    with pytest.raises(CompletionError) as failure:
        complete(
            dense_pair.decode.url,
            prompt,
            max_tokens=MAX_TOKENS,
            kv_transfer_params=push_decode_leg_params(mint_transfer_id(), dense_pair.coordinates),
        )
    elapsed = time.monotonic() - started
    assert failure.value.status is not None and failure.value.status >= 500
    assert elapsed < TRANSFER_TIMEOUT_S + DEADLINE_SLACK_S
    assert wait_for_free_blocks(dense_pair) == {"prefill": 0.0, "decode": 0.0}
    # Both engines keep serving P/D traffic.
    result = dense_pair.push(prompt, MAX_TOKENS)
    assert (
        output_differences(dense_pair.colocated(prompt, MAX_TOKENS), result.decode, logprob_atol=LOGPROB_ATOL)
        == []
    )


@pytest.mark.timeout(600)
def test_a_decode_leg_naming_an_unreachable_prefill_fails_promptly(dense_pair: PDPair) -> None:
    nowhere = PrefillCoordinates("nobody", LOOPBACK, reserve_ports(1)[0], 1)
    started = time.monotonic()
    with pytest.raises(CompletionError):
        complete(
            dense_pair.decode.url,
            prompt_of(50),
            max_tokens=MAX_TOKENS,
            kv_transfer_params=push_decode_leg_params(mint_transfer_id(), nowhere),
        )
    assert time.monotonic() - started < TRANSFER_TIMEOUT_S
    assert wait_for_free_blocks(dense_pair)["decode"] == 0.0


@pytest.mark.timeout(600)
def test_prefill_killed_before_its_write_fails_the_decode_within_the_deadline_and_decode_survives(
    dense_pair: PDPair,
) -> None:
    prompt = prompt_of(200, seed=9)
    colocated = dense_pair.colocated(prompt, MAX_TOKENS)
    dense_pair.prefill.stop(grace_s=0)  # SIGTERM then SIGKILL of the whole engine
    started = time.monotonic()
    with pytest.raises(CompletionError):
        complete(
            dense_pair.decode.url,
            prompt,
            max_tokens=MAX_TOKENS,
            kv_transfer_params=push_decode_leg_params(mint_transfer_id(), dense_pair.coordinates),
        )
    assert time.monotonic() - started < TRANSFER_TIMEOUT_S + DEADLINE_SLACK_S
    # The request ended with its failure; its blocks come back once every rank confirmed nothing can land in
    # them (a step later here: the prefill is gone), not at the end of the fence (over 30 s). The gauge moves
    # on a logged engine step: 3.8 s after a release under CI's load (an earlier run).
    released_by = time.monotonic() + 15.0
    while kv_cache_usage(dense_pair.decode) and time.monotonic() < released_by:
        time.sleep(0.2)
    assert kv_cache_usage(dense_pair.decode) == 0.0
    assert (
        output_differences(colocated, dense_pair.colocated(prompt, MAX_TOKENS), logprob_atol=LOGPROB_ATOL)
        == []
    )
