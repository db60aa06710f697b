"""The engine harness itself: output comparison, parsing, process handling (no engine started here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.pdconnector.vllm.harness import (
    Completion,
    CompletionError,
    EngineLauncher,
    EngineStartError,
    output_differences,
    parse_completion,
    process_group_cpu_seconds,
    run_concurrently,
)


def completion(token_ids: list[int], top: list[dict[int, float]]) -> Completion:
    return Completion(token_ids, [], top, None, "length", 0.0, {})


def test_identical_generations_have_no_differences() -> None:
    top = [{5: -0.1, 6: -2.0, 7: -3.0, 8: -4.0, 9: -5.0}]
    assert output_differences(completion([5], top), completion([5], top)) == []


def test_a_different_token_or_shifted_logprob_is_reported() -> None:
    reference = completion([5], [{5: -0.1, 6: -2.0, 7: -3.0, 8: -4.0, 9: -5.0}])
    assert output_differences(reference, completion([6], reference.top_logprobs))
    shifted = completion([5], [{5: -0.1, 6: -2.01, 7: -3.0, 8: -4.0, 9: -5.0}])
    assert any("token 6" in difference for difference in output_differences(reference, shifted))


def test_a_near_tie_at_the_top_k_cut_off_may_swap_but_a_strong_entry_may_not_vanish() -> None:
    reference = completion([5], [{5: -0.1, 6: -2.0, 7: -3.0, 8: -4.0, 9: -5.0}])
    tie_swapped = completion([5], [{5: -0.1, 6: -2.0, 7: -3.0, 8: -4.0, 10: -5.0}])
    assert output_differences(reference, tie_swapped) == []
    strong_missing = completion([5], [{5: -0.1, 10: -2.0, 7: -3.0, 8: -4.0, 9: -5.0}])
    assert any("missing" in difference for difference in output_differences(reference, strong_missing))


def test_completion_parsing_reads_token_ids_logprobs_and_transfer_params() -> None:
    body = {
        "choices": [
            {
                "token_ids": [3, 4],
                "prompt_token_ids": [1],
                "finish_reason": "length",
                "logprobs": {
                    "top_logprobs": [{"token_id:3": -0.5, "token_id:9": -1.5}, {"token_id:4": -0.25}]
                },
            }
        ],
        "kv_transfer_params": {"remote_block_ids": [[1]]},
    }
    parsed = parse_completion(body, 0.1)
    assert parsed.token_ids == [3, 4]
    assert parsed.top_logprobs == [{3: -0.5, 9: -1.5}, {4: -0.25}]
    assert parsed.kv_transfer_params == {"remote_block_ids": [[1]]}


def test_cpu_accounting_sees_our_own_process_group() -> None:
    assert process_group_cpu_seconds(os.getpgrp()) > 0


def test_concurrent_calls_return_in_order_and_surface_the_first_failure() -> None:
    assert run_concurrently([lambda i=i: i * i for i in range(16)], max_workers=16) == [
        i * i for i in range(16)
    ]

    def fail() -> None:
        raise CompletionError("http://engine", 500, "boom")

    with pytest.raises(CompletionError, match="HTTP 500"):
        run_concurrently([lambda: 1, fail], max_workers=2)


@pytest.mark.slow
def test_a_server_that_exits_while_starting_is_reported_with_its_log(
    tmp_path: Path, launch_engine: EngineLauncher
) -> None:
    # A bad model directory makes vLLM's API server exit on argument validation, before any engine starts.
    server = launch_engine("broken", tmp_path / "no-such-model")
    with pytest.raises(EngineStartError, match=r"(?s)broken exited with \d+ while starting:.*no-such-model"):
        server.wait_healthy(timeout_s=120)
    server.stop()
    assert not server.is_running()
