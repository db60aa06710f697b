"""Our connector on real vLLM CPU engines with a hybrid NemotronH (Mamba2 + attention) model over real NIXL
(UCX).

The conv state is in the DS layout (set explicitly on both engines, see ``pd_engines.ENGINE_ENV``);
prefill stops one prompt token short and decode recomputes it, so the Mamba state decode continues
from is the one it derives itself. Disaggregated output must equal co-located output.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from pdconnector.protocol.params import (
    RECEIVED_KEY,
    TransferMode,
    mint_transfer_id,
    prefill_leg_params,
    push_decode_leg_params,
)

from tests.pdconnector.vllm.harness import CompletionError, complete, output_differences, run_concurrently
from tests.pdconnector.vllm.pd_engines import (
    BATCHED_LOGPROB_ATOL,
    CONCURRENT,
    LOGPROB_ATOL,
    MAX_TOKENS,
    PROMPT_LENGTHS,
    PDPair,
    assert_disaggregated_equals_colocated,
    kv_cache_usage,
    pd_pair,
    prompt_of,
    wait_for_free_blocks,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hybrid_pair(hybrid_model: Path, engine_log_dir: Path) -> Iterator[PDPair]:
    with pd_pair("ours-hybrid", hybrid_model, engine_log_dir) as pair:
        yield pair


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_hybrid_disaggregated_output_equals_colocated_output_for_every_prompt_length(
    hybrid_pair: PDPair, mode: TransferMode
) -> None:
    assert_disaggregated_equals_colocated(hybrid_pair, mode, PROMPT_LENGTHS)
    assert wait_for_free_blocks(hybrid_pair) == {"prefill": 0.0, "decode": 0.0}


@pytest.mark.timeout(900)
def test_hybrid_sixteen_concurrent_push_requests_match_their_colocated_outputs(hybrid_pair: PDPair) -> None:
    prompts = [prompt_of(50 + 61 * i, seed=200 + i) for i in range(CONCURRENT)]
    colocated = [hybrid_pair.colocated(prompt, MAX_TOKENS) for prompt in prompts]

    results = run_concurrently(
        [lambda p=prompt: hybrid_pair.push(p, MAX_TOKENS, timeout_s=300) for prompt in prompts],
        max_workers=CONCURRENT,
    )

    for prompt, expected, result in zip(prompts, colocated, results, strict=True):
        assert output_differences(expected, result.decode, logprob_atol=BATCHED_LOGPROB_ATOL) == [], (
            f"prompt of {len(prompt)} tokens"
        )
        assert (result.decode.kv_transfer_params or {}).get(RECEIVED_KEY)
    assert wait_for_free_blocks(hybrid_pair) == {"prefill": 0.0, "decode": 0.0}


@pytest.mark.timeout(600)
def test_decode_killed_during_a_push_leaves_prefill_serving_with_every_block_freed(
    hybrid_pair: PDPair,
) -> None:
    """Decode registers, dies, then prefill finishes and pairs with the dead registration: its WRITE fails and
    it frees.

    Destructive (decode is gone afterwards), so it runs last in the module."""
    prompt = prompt_of(900, seed=31)
    colocated = hybrid_pair.colocated(prompt, MAX_TOKENS)
    transfer_id = mint_transfer_id()
    with ThreadPoolExecutor(max_workers=1) as pool:
        decode_leg = pool.submit(
            complete,
            hybrid_pair.decode.url,
            prompt,
            max_tokens=MAX_TOKENS,
            kv_transfer_params=push_decode_leg_params(transfer_id, hybrid_pair.coordinates),
        )
        time.sleep(2.0)  # the registration is out
        hybrid_pair.decode.stop(grace_s=0)
        with pytest.raises(CompletionError):
            decode_leg.result()
    complete(
        hybrid_pair.prefill.url,
        prompt,
        max_tokens=1,
        kv_transfer_params=prefill_leg_params(TransferMode.PUSH, transfer_id),
    )
    deadline = time.monotonic() + 45
    while kv_cache_usage(hybrid_pair.prefill) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert kv_cache_usage(hybrid_pair.prefill) == 0.0
    # The surviving prefill engine still computes the same function.
    assert (
        output_differences(
            colocated,
            complete(hybrid_pair.prefill.url, prompt, max_tokens=MAX_TOKENS),
            logprob_atol=LOGPROB_ATOL,
        )
        == []
    )
