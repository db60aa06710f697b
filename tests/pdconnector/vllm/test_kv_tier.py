"""The KV tier on real vLLM CPU engines: multi-turn conversations, each turn resending the whole history, push
and pull. Decode keeps what it received and generated in its tier (vLLM's prefix cache off, so the tier is the
only place the history survives), loads it on the next turn, and takes only the new suffix from prefill; every
answer equals co-located serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pdconnector.protocol.params import RECEIVED_KEY, TransferMode

from tests.pdconnector.vllm.harness import metric_sum, output_differences, scrape_metrics
from tests.pdconnector.vllm.pd_engines import (
    BLOCK_SIZE,
    LOGPROB_ATOL,
    MAX_TOKENS,
    PDPair,
    pd_pair,
    prompt_of,
    wait_for_free_blocks,
)

pytestmark = pytest.mark.slow

TIER_BYTES = 64 << 20
FIRST_PROMPT = 2 * BLOCK_SIZE + 40  # the history's first turn: two full blocks and a partial one
USER_TOKENS = 40  # each later turn adds the answer and this many new tokens


@pytest.fixture(scope="module")
def tier_pair(dense_model: Path, engine_log_dir: Path) -> Iterator[PDPair]:
    with pd_pair("tier", dense_model, engine_log_dir, decode_extra={"tier_bytes": TIER_BYTES}) as pair:
        yield pair


def blocks_of(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_each_turn_loads_the_history_from_decodes_tier_and_receives_only_the_new_suffix(
    tier_pair: PDPair, mode: TransferMode
) -> None:
    seed = 1 if mode is TransferMode.PUSH else 2  # each mode its own conversation: nothing of the other's
    history = prompt_of(FIRST_PROMPT, seed=seed)
    before = scrape_metrics(tier_pair.decode.url)
    computed_before = 0  # tokens of the last turn whose KV decode computed or received (the tier's share)
    received_per_turn = []
    for turn in range(3):
        prompt = history if turn == 0 else history + prompt_of(USER_TOKENS, seed=10 * seed + turn)
        colocated = tier_pair.colocated(prompt, MAX_TOKENS)
        result = tier_pair.run(mode, prompt, MAX_TOKENS)
        assert output_differences(colocated, result.decode, logprob_atol=LOGPROB_ATOL) == [], f"turn {turn}"
        received = (result.decode.kv_transfer_params or {})[RECEIVED_KEY]
        from_tier = computed_before // BLOCK_SIZE  # full blocks of the last turn, saved when it finished
        expected = (from_tier, blocks_of(len(prompt)) - from_tier)
        assert (received["tier_blocks"], received["blocks"]) == expected, f"turn {turn}: {received}"
        received_per_turn.append(received["blocks"])
        computed_before = len(prompt) + MAX_TOKENS - 1  # the last sampled token has no KV
        history = prompt + result.decode.token_ids
    assert received_per_turn[1] < blocks_of(FIRST_PROMPT + MAX_TOKENS + USER_TOKENS)
    after = scrape_metrics(tier_pair.decode.url)
    tier_tokens = metric_sum(after, "vllm:pd_kv_tokens", labels={"source": "tier"}) - metric_sum(
        before, "vllm:pd_kv_tokens", labels={"source": "tier"}
    )
    assert tier_tokens > 0
    assert wait_for_free_blocks(tier_pair) == {"prefill": 0.0, "decode": 0.0}
