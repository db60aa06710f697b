"""Tiny real models: what vLLM loads in `pdctl up --engine vllm`, the benchmarks and the real-engine tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from pdconnector.layout.known_models import QWEN3_32B
from pdconnector.layout.model import model_from_hf_config
from pdconnector.sim.tiny_model import HYBRID_CONFIG, MODEL_CONFIGS, TinyModel, write_tiny_model
from pdconnector.sim.tokenizer import words, write_word_tokenizer


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("dense"), TinyModel.DENSE)


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("hybrid"), TinyModel.HYBRID)


def test_word_tokenizer_round_trips_every_token_id(tmp_path: Path) -> None:
    write_word_tokenizer(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = list(range(1024))
    assert tokenizer(words(ids), add_special_tokens=False)["input_ids"] == ids
    assert tokenizer.decode(ids) == words(ids)


def test_dense_model_is_written_with_seeded_weights_that_vllm_can_read(dense_model: Path) -> None:
    config = json.loads((dense_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (
        config["hidden_size"],
        config["num_hidden_layers"],
        config["num_key_value_heads"],
        config["head_dim"],
    ) == (128, 2, 2, 32)
    assert (dense_model / "model.safetensors").stat().st_size > 1_000_000
    model = transformers.AutoModelForCausalLM.from_pretrained(dense_model)
    # Far from vLLM's dummy U(-1e-3, 1e-3) weights, which make every logit ~0.
    assert model.lm_head.weight.std().item() > 0.1


def test_hybrid_model_config_keeps_the_mamba2_shape_the_tests_rely_on(hybrid_model: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(hybrid_model)
    assert config.layers_block_type == [
        "linear_attention",
        "mlp",
        "linear_attention",
        "full_attention",
        "mlp",
    ]
    assert (config.mamba_num_heads, config.mamba_head_dim, config.n_groups, config.ssm_state_size) == (
        8,
        32,
        2,
        16,
    )
    assert (
        json.loads((hybrid_model / "config.json").read_text())["hybrid_override_pattern"]
        == HYBRID_CONFIG["hybrid_override_pattern"]
    )


def test_the_same_seed_writes_the_same_weights(dense_model: Path, tmp_path: Path) -> None:
    again = write_tiny_model(tmp_path / "again", TinyModel.DENSE)
    assert (again / "model.safetensors").read_bytes() == (dense_model / "model.safetensors").read_bytes()


def test_the_qwen3_32b_twin_has_the_real_models_kv_geometry_and_a_small_body() -> None:
    twin, real = MODEL_CONFIGS[TinyModel.QWEN3_32B_KV_TWIN], QWEN3_32B

    def kv_bytes_per_token(config: dict) -> int:
        model = model_from_hf_config(config)
        assert model.attention is not None
        return model.num_attention_layers * model.attention.bytes_per_token

    assert kv_bytes_per_token(twin) == kv_bytes_per_token(real) == 256 << 10
    assert twin["hidden_size"] * 10 == real["hidden_size"]  # a tenth of the width: compute stays modest
    assert transformers.AutoConfig.for_model(**twin).num_key_value_heads == 8  # a config transformers reads
