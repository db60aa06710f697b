"""The KV tier on real vLLM engines (the CPU's, or the GPU's under ``PD_VLLM_TEST_DEVICE=cuda``): multi-turn
conversations, each turn resending the whole history, push and pull. Decode keeps what it received and
generated in its tier (vLLM's prefix cache off, so the tier is the only place the history survives), loads it
on the next turn, and takes only the new suffix from prefill; prefill keeps the prompts it computed in a tier
of its own and loads them instead of computing them again; every answer equals co-located serving, and
vLLM's own hit-source metric names the tier (host) and prefill (p2p) as our counters do."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pdconnector.protocol.params import RECEIVED_KEY, TransferMode
from pdconnector.router.kv_events import EventFeed, parse_message
from pdconnector.router.prefix import BlockHasher, PrefixIndex

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
from tests.pdconnector.vllm.test_kv_events_from_engines import events_config, subscribed
from tests.ports import ipc_endpoint

pytestmark = pytest.mark.slow

TIER_BYTES = 64 << 20
FIRST_PROMPT = 2 * BLOCK_SIZE + 40  # the history's first turn: two full blocks and a partial one
USER_TOKENS = 40  # each later turn adds the answer and this many new tokens
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source"  # vLLM's hit tokens by tier (ours: host and p2p)


@pytest.fixture(scope="module")
def decode_events() -> Iterator[str]:
    """Where decode publishes its KV cache events."""
    with ipc_endpoint() as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def tier_pair(dense_model: Path, engine_log_dir: Path, decode_events: str) -> Iterator[PDPair]:
    tier = {"tier_bytes": TIER_BYTES}
    with pd_pair(
        "tier",
        dense_model,
        engine_log_dir,
        prefill_extra=tier,
        decode_extra=tier,
        decode_args=("--kv-events-config", events_config(decode_events)),
    ) as pair:
        yield pair


def blocks_of(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_each_turn_loads_the_history_from_the_tiers_and_moves_only_the_new_suffix(
    tier_pair: PDPair, mode: TransferMode
) -> None:
    seed = 1 if mode is TransferMode.PUSH else 2  # each mode its own conversation: nothing of the other's
    history = prompt_of(FIRST_PROMPT, seed=seed)
    before = scrape_metrics(tier_pair.decode.url)
    prefill_before = scrape_metrics(tier_pair.prefill.url)
    computed_before = 0  # tokens of the last turn whose KV decode computed or received (the tier's share)
    prefill_tier_tokens = 0  # the full blocks of each earlier prompt, which prefill saved after sending them
    last_prompt: list[int] = []
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
        prefill_tier_tokens += len(last_prompt) // BLOCK_SIZE * BLOCK_SIZE
        computed_before = len(prompt) + MAX_TOKENS - 1  # the last sampled token has no KV
        last_prompt = prompt
        history = prompt + result.decode.token_ids
    assert received_per_turn[1] < blocks_of(FIRST_PROMPT + MAX_TOKENS + USER_TOKENS)
    after = scrape_metrics(tier_pair.decode.url)
    tier_tokens = _grown(before, after, "vllm:pd_kv_tokens", "tier")
    assert tier_tokens > 0
    # vLLM's own split of the external hits names the same tiers: host memory, and another instance (prefill)
    assert _grown(before, after, CACHED_BY_SOURCE, "host") == tier_tokens
    assert _grown(before, after, CACHED_BY_SOURCE, "p2p") == _grown(
        before, after, "vllm:pd_kv_tokens", "remote"
    )
    assert wait_for_free_blocks(tier_pair) == {"prefill": 0.0, "decode": 0.0}
    prefill_after = scrape_metrics(tier_pair.prefill.url)
    loaded = _grown(prefill_before, prefill_after, "vllm:pd_kv_tokens", "tier")
    assert loaded == prefill_tier_tokens > 0
    assert _grown(prefill_before, prefill_after, CACHED_BY_SOURCE, "host") == loaded


def _grown(before: str, after: str, name: str, source: str, *, label: str = "source") -> float:
    """How much a metric's sample labelled ``source`` grew between two scrapes."""
    return metric_sum(after, name, labels={label: source}) - metric_sum(before, name, labels={label: source})


@pytest.mark.timeout(600)
def test_decode_publishes_what_its_tier_holds_as_the_routers_block_hashes(
    tier_pair: PDPair, decode_events: str
) -> None:
    hasher = BlockHasher(BLOCK_SIZE, "sha256")  # vLLM's default hashing, as the router is told
    feed = EventFeed(PrefixIndex(100_000), tier_index=PrefixIndex(100_000))
    assert feed.tier_index is not None
    with subscribed(decode_events) as (socket, _):
        # A ZMQ subscriber misses what is published before its subscription reaches the engine.
        time.sleep(1.0)
        prompt = prompt_of(3 * BLOCK_SIZE + 9, seed=3)
        result = tier_pair.run(TransferMode.PUSH, prompt, MAX_TOKENS)
        computed = prompt + result.decode.token_ids[:-1]  # the last sampled token has no KV
        expected = hasher.block_hashes(computed)
        deadline = time.monotonic() + 30.0
        while feed.tier_index.matched_blocks(expected) < len(expected) and time.monotonic() < deadline:
            if socket.poll(200):
                feed.apply(*parse_message(socket.recv_multipart()))
    assert feed.tier_index.matched_blocks(expected) == len(expected) == len(computed) // BLOCK_SIZE
    assert len(feed.index) == 0  # decode's prefix cache is off: these are the tier's blocks alone


@pytest.mark.timeout(600)
def test_a_tier_load_that_fails_falls_back_to_prefills_transfer_on_decode_and_to_recomputing_on_prefill(
    dense_model: Path, engine_log_dir: Path
) -> None:
    tier = {"tier_bytes": TIER_BYTES}
    with pd_pair(
        "tier-faults",
        dense_model,
        engine_log_dir,
        policy="recompute",  # as the operator renders it for a prefill with a tier
        prefill_extra=tier,
        decode_extra=tier,
        module="tests.pdconnector.vllm.failing_tier",
    ) as pair:
        history = prompt_of(FIRST_PROMPT, seed=4)
        first = pair.run(TransferMode.PUSH, history, MAX_TOKENS)  # both tiers save it (saves do not fail)
        assert wait_for_free_blocks(pair) == {"prefill": 0.0, "decode": 0.0}  # saved: blocks held until then
        prompt = history + first.decode.token_ids + prompt_of(USER_TOKENS, seed=41)
        before = scrape_metrics(pair.decode.url), scrape_metrics(pair.prefill.url)
        result = pair.run(TransferMode.PUSH, prompt, MAX_TOKENS)  # both tiers hold its start; loads fail
        colocated = pair.colocated(prompt, MAX_TOKENS)
        assert output_differences(colocated, result.decode, logprob_atol=LOGPROB_ATOL) == []
        received = (result.decode.kv_transfer_params or {})[RECEIVED_KEY]
        # every block from prefill: the tier's run too
        assert (received["tier_blocks"], received["blocks"]) == (0, blocks_of(len(prompt)))
        after = scrape_metrics(pair.decode.url), scrape_metrics(pair.prefill.url)
    for role, was, now in zip(("decode", "prefill"), before, after, strict=True):
        failed = _grown(was, now, "vllm:pd_kv_tier_events", "tier_loads_failed", label="event")
        assert failed == 1, f"{role}: {failed} tier loads counted failed"
        assert _grown(was, now, "vllm:pd_kv_tokens", "tier") == 0, role
    decode_was, decode_now = before[0], after[0]
    assert _grown(decode_was, decode_now, "vllm:pd_kv_tokens", "remote") == len(prompt)  # all from prefill
    prefill_was, prefill_now = before[1], after[1]
    assert _grown(prefill_was, prefill_now, "vllm:pd_kv_tokens", "computed") == len(prompt)  # recomputed
