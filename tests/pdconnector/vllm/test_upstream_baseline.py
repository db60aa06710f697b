"""Upstream vLLM's NixlConnector (pull) on real CPU engines: the baseline our connector is measured against.

Kept to one bounded equivalence check so CI stays short; the timings and the upstream
push behaviour are measured by ``e2e/vllm/baseline.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pdconnector.vllm.harness import (
    EnginePair,
    UpstreamConnector,
    complete,
    launch_upstream_pair,
    metric_total,
    output_differences,
    pd_pull,
    running_servers,
)

pytestmark = pytest.mark.slow

BLOCK_SIZE = 128  # vLLM's default on the CPU backend
# Upstream's first P/D request pays its side-channel handshake (tens of seconds on a busy 2-core box).
PD_REQUEST_TIMEOUT_S = 400.0


@pytest.fixture(scope="module")
def upstream_pull_pair(dense_model: Path, engine_log_dir: Path) -> Iterator[EnginePair]:
    pair = launch_upstream_pair(UpstreamConnector.PULL, dense_model, engine_log_dir)
    with running_servers(pair.prefill, pair.decode):
        yield pair


@pytest.mark.timeout(1500)
def test_upstream_pull_disaggregated_output_equals_colocated_output(upstream_pull_pair: EnginePair) -> None:
    pair = upstream_pull_pair
    # One full block plus one token: the transfer must carry a full block and a partial one.
    prompt = [(11 * i + 5) % 1024 for i in range(BLOCK_SIZE + 1)]
    colocated = complete(pair.decode.url, prompt, max_tokens=6)
    bytes_before = metric_total(pair.decode.url, "vllm:nixl_bytes_transferred")

    result = pd_pull(pair.prefill.url, pair.decode.url, prompt, max_tokens=6, timeout_s=PD_REQUEST_TIMEOUT_S)

    assert result.prefill.kv_transfer_params is not None
    assert result.prefill.kv_transfer_params["remote_engine_id"] == pair.prefill_engine_id
    assert result.prefill.kv_transfer_params["remote_block_ids"], "prefill kept no blocks for decode"
    assert output_differences(colocated, result.decode, logprob_atol=1e-4) == []
    assert result.decode.prompt_token_ids == prompt
    # The decode engine really read the prompt's KV from prefill (one block of 2 layers at least).
    assert metric_total(pair.decode.url, "vllm:nixl_bytes_transferred") - bytes_before >= 2 * 65536
