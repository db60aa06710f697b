"""Heterogeneous tensor parallelism on real vLLM CPU engines: a TP=1 and a TP=2 engine, each prefill for the
other.

Both tiny models have 2 KV heads: a TP=2 engine holds one per rank. From TP=1 to TP=2 each decode rank
takes its head's slice of the one prefill rank's blocks; from TP=2 to TP=1 the decode rank's blocks are
filled by both prefill ranks, one head each. The hybrid model's Mamba2 state splits the same way (4 of
its 8 heads and 1 of its 2 groups per rank): x, B and C of the DS conv state and the temporal state are
sliced per rank. Two ``kv_both`` engines per model cover both directions with two start-ups.
Disaggregated output must equal the decode engine's co-located output, in push and pull.

These engines push through the staged path (``transfer_path: staged``): prefill gathers each request into a
slot of its staging buffer, one WRITE per rank pair moves it into the slot decode offered, and decode
scatters it into its blocks; the other vLLM suites push direct. Pull always reads direct.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pdconnector.protocol.params import TransferMode

from tests.pdconnector.vllm.harness import launch_server, metric_sum, running_servers, scrape_metrics
from tests.pdconnector.vllm.pd_engines import (
    BLOCK_SIZE,
    ENGINE_ENV,
    PDPair,
    assert_disaggregated_equals_colocated,
    connector_config,
    reserve_ports,
    wait_for_free_blocks,
    warm_up,
)

pytestmark = pytest.mark.slow

PROMPT_LENGTHS = (1, BLOCK_SIZE + 1, 600)
STAGED = {"staging_mib": 16, "transfer_path": "staged"}


@dataclass(frozen=True)
class MixedTp:
    one_to_two: PDPair  # prefill TP=1, decode TP=2
    two_to_one: PDPair  # prefill TP=2, decode TP=1


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def mixed_tp(request: pytest.FixtureRequest, engine_log_dir: Path) -> Iterator[MixedTp]:
    model: Path = request.getfixturevalue(f"{request.param}_model")
    sc_1, sc_2, http_1, http_2 = reserve_ports(4)
    tp1 = launch_server(
        "tp1",
        model,
        engine_log_dir,
        kv_transfer_config=connector_config("tp1", "kv_both", sc_1, extra=STAGED),
        env=ENGINE_ENV,
        port=http_1,
    )
    tp2 = launch_server(
        "tp2",
        model,
        engine_log_dir,
        kv_transfer_config=connector_config("tp2", "kv_both", sc_2, extra=STAGED),
        env=ENGINE_ENV,
        port=http_2,
        extra_args=("--tensor-parallel-size", "2"),
    )
    with running_servers(tp1, tp2):
        warm_up(tp1, tp2)
        yield MixedTp(
            one_to_two=PDPair(tp1, tp2, "tp1", sc_1, 1), two_to_one=PDPair(tp2, tp1, "tp2", sc_2, 2)
        )


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
@pytest.mark.parametrize("direction", ["one_to_two", "two_to_one"])
def test_disaggregated_output_across_different_tp_sizes_equals_the_decode_engines_colocated_output(
    mixed_tp: MixedTp, direction: str, mode: TransferMode
) -> None:
    pair: PDPair = getattr(mixed_tp, direction)
    staged_before = staged_writes(pair)
    assert_disaggregated_equals_colocated(pair, mode, PROMPT_LENGTHS, first_seed=70)
    assert wait_for_free_blocks(pair) == {"prefill": 0.0, "decode": 0.0}
    if mode is TransferMode.PUSH:
        # both rank pairs of each prompt that moves KV (the multi-token ones) WRITE through a slot
        assert staged_writes(pair) - staged_before >= 2 * (len(PROMPT_LENGTHS) - 1)
    else:
        assert staged_writes(pair) == staged_before


def staged_writes(pair: PDPair) -> float:
    return metric_sum(
        scrape_metrics(pair.prefill.url), "vllm:pd_kv_staging_events", labels={"event": "writes_staged"}
    )
