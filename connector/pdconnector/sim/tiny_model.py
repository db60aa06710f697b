"""Tiny real models for vLLM on the CPU: config, seeded random weights and a word-level tokenizer.

What `pdctl up --engine vllm`, the benchmarks and the real-engine tests run: a Llama-like dense
model and a NemotronH-like hybrid (Mamba2 + attention), small enough for a 2-core machine. The
same seed gives the same weights in every process, so a co-located engine and a prefill/decode
pair compute the same function and their outputs can be compared token for token.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Any

from pdconnector.layout.known_models import QWEN3_32B
from pdconnector.sim.tokenizer import write_word_tokenizer

VOCAB_SIZE = 1024
WEIGHT_INIT_STD = 0.2


class TinyModel(StrEnum):
    DENSE = "dense"
    # Wide enough that computing a prompt dominates a request on the CPU (a 1k-token prefill takes a few
    # hundred ms on one core), as for real models on GPUs: what the routing benchmark's cache hits save.
    DENSE_WIDE = "dense-wide"
    HYBRID = "hybrid"
    # Qwen3-32B's KV geometry (64 layers, 8 KV heads of 128, bf16: 256 KiB of KV per token at TP 1) with small
    # hidden and MLP sizes: transfers move the real model's bytes while compute stays modest (GPU benchmarks).
    QWEN3_32B_KV_TWIN = "qwen3-32b-kv-twin"


_COMMON_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}

DENSE_CONFIG: dict[str, Any] = {
    **_COMMON_CONFIG,
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}

DENSE_WIDE_CONFIG: dict[str, Any] = {
    **DENSE_CONFIG,
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
}

# M = Mamba2 mixer, - = MLP, * = attention. Mamba: 8 heads x 32 = expand(1) x hidden(256).
HYBRID_CONFIG: dict[str, Any] = {
    **_COMMON_CONFIG,
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hybrid_override_pattern": "M-M*-",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "mamba_num_heads": 8,
    "mamba_head_dim": 32,
    "n_groups": 2,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "expand": 1,
    "chunk_size": 2048,
    "mamba_ssm_cache_dtype": "float32",
    "mlp_hidden_act": "relu2",
    "layer_norm_epsilon": 1e-5,
}

QWEN3_32B_KV_TWIN_CONFIG: dict[str, Any] = {
    **_COMMON_CONFIG,
    **{
        key: QWEN3_32B[key] for key in ("num_hidden_layers", "num_key_value_heads", "head_dim", "torch_dtype")
    },
    "architectures": QWEN3_32B["architectures"],
    "model_type": "qwen3",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_attention_heads": QWEN3_32B["num_key_value_heads"],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 40_960,
}

MODEL_CONFIGS: dict[TinyModel, dict[str, Any]] = {
    TinyModel.DENSE: DENSE_CONFIG,
    TinyModel.DENSE_WIDE: DENSE_WIDE_CONFIG,
    TinyModel.HYBRID: HYBRID_CONFIG,
    TinyModel.QWEN3_32B_KV_TWIN: QWEN3_32B_KV_TWIN_CONFIG,
}


def write_tiny_model(
    model_dir: Path, kind: TinyModel, *, seed: int = 0, initializer_range: float = WEIGHT_INIT_STD
) -> Path:
    """Write a tiny model (config.json, seeded random safetensors weights, word-level tokenizer) into
    ``model_dir``.

    vLLM's ``--load-format dummy`` draws weights from U(-1e-3, 1e-3): every logit is ~0, all
    1024 tokens tie at logprob -6.93 and a corrupted KV transfer would go unnoticed. Weights
    drawn by transformers' initializer at a larger scale give peaked, position-dependent
    distributions, so a wrong KV changes tokens and logprobs.
    """
    model_dir.mkdir(parents=True, exist_ok=True)
    config_path = model_dir / "config.json"
    config_path.write_text(
        json.dumps({**MODEL_CONFIGS[kind], "initializer_range": initializer_range}, indent=2)
    )
    import torch  # noqa: PLC0415 - engine extra; importing this module must not need it
    import transformers  # noqa: PLC0415

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(model_dir),
        dtype=getattr(torch, MODEL_CONFIGS[kind]["torch_dtype"]),
    )
    model.save_pretrained(model_dir)
    # save_pretrained rewrites config.json in transformers' own dialect; keep ours (what vLLM is tested with).
    config_path.write_text(
        json.dumps({**MODEL_CONFIGS[kind], "initializer_range": initializer_range}, indent=2)
    )
    write_word_tokenizer(model_dir)
    return model_dir
