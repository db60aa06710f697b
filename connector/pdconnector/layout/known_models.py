"""Configs of published models that benchmarks and analyses refer to (the fields the layout model reads)."""

from __future__ import annotations

from typing import Any

# NVIDIA-Nemotron-Nano-9B-v2 (its config.json): 56 layers, 27 Mamba2 ("M"), 4 attention ("*"), 25 MLP ("-").
NEMOTRON_NANO_9B_V2: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "hidden_size": 4480,
    "num_hidden_layers": 56,
    "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
    "mamba_num_heads": 128,
    "mamba_head_dim": 80,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
    "mamba_ssm_cache_dtype": "float32",
}

# Qwen3-32B (its config.json): 64 layers, 8 KV heads of 128, bf16; 4 MiB of KV per 16-token block at TP 1.
QWEN3_32B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 5120,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
}

# Llama-3.3-70B-Instruct (its config.json): 80 layers, 8 KV heads of 128 (8192 / 64 heads), bf16.
LLAMA_3_3_70B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}

# NVIDIA-Nemotron-3-Super-120B-A12B: 88 layers, 40 Mamba2 ("M"), 8 attention ("*"), 40 LatentMoE ("E"),
# hidden 4096; Mamba2 128 heads of 64, state 128, conv kernel 4, expand 2; attention 2 KV heads of 128 (8 KiB
# of bf16 KV per token over the 8 layers). Sources: the model's HF config.json as summarised at
# glennklockwood.com/garden/Nemotron-3 (layer pattern, Mamba sizes) and colaberry.ai's architecture page (KV
# per token); n_groups 8 and the fp32 SSM cache follow the family's published NVIDIA-Nemotron-3-Nano-30B-A3B
# config (not stated for Super in those sources). At TP 4 and above every rank holds one replicated KV head.
NEMOTRON_3_SUPER_120B: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "hidden_size": 4096,
    "num_hidden_layers": 88,
    "hybrid_override_pattern": "MEMEMEM*" + "EMEMEMEM*" * 2 + "EMEMEMEMEM*" * 4 + "EMEMEMEM*" + "EMEMEMEME",
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
    "mamba_ssm_cache_dtype": "float32",
}
