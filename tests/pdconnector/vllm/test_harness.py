"""The engine harness itself: models, tokenizer and output comparison (no engine started here)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import transformers
from pdconnector.sim.tokenizer import words, write_word_tokenizer

from tests.pdconnector.vllm.harness import (
    HYBRID_CONFIG,
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


def test_word_tokenizer_round_trips_every_token_id(tmp_path: Path) -> None:
    write_word_tokenizer(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = list(range(1024))
    assert tokenizer(words(ids), add_special_tokens=False)["input_ids"] == ids
    assert tokenizer.decode(ids) == words(ids)


def test_dense_model_is_written_with_seeded_weights_that_vllm_can_read(dense_model: Path) -> None:
    config = json.loads((dense_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (128, 2, 2, 32)
    assert (dense_model / "model.safetensors").stat().st_size > 1_000_000
    model = transformers.AutoModelForCausalLM.from_pretrained(dense_model)
    # Far from vLLM's dummy U(-1e-3, 1e-3) weights, which make every logit ~0.
    assert model.lm_head.weight.std().item() > 0.1


def test_hybrid_model_config_keeps_the_mamba2_shape_the_tests_rely_on(hybrid_model: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(hybrid_model)
    assert config.layers_block_type == ["linear_attention", "mlp", "linear_attention", "full_attention", "mlp"]
    assert (config.mamba_num_heads, config.mamba_head_dim, config.n_groups, config.ssm_state_size) == (8, 32, 2, 16)
    assert json.loads((hybrid_model / "config.json").read_text())["hybrid_override_pattern"] == HYBRID_CONFIG["hybrid_override_pattern"]


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
                "logprobs": {"top_logprobs": [{"token_id:3": -0.5, "token_id:9": -1.5}, {"token_id:4": -0.25}]},
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
    assert run_concurrently([lambda i=i: i * i for i in range(16)], max_workers=16) == [i * i for i in range(16)]

    def fail() -> None:
        raise CompletionError("http://engine", 500, "boom")

    with pytest.raises(CompletionError, match="HTTP 500"):
        run_concurrently([lambda: 1, fail], max_workers=2)


@pytest.mark.slow
def test_a_server_that_exits_while_starting_is_reported_with_its_log(tmp_path: Path, launch_engine: EngineLauncher) -> None:
    # A bad model directory makes vLLM's API server exit on argument validation, before any engine starts.
    server = launch_engine("broken", tmp_path / "no-such-model")
    with pytest.raises(EngineStartError, match=r"(?s)broken exited with \d+ while starting:.*no-such-model"):
        server.wait_healthy(timeout_s=120)
    server.stop()
    assert not server.is_running()
