"""Page geometry per rank as vLLM's hybrid allocator lays it out, checked against hand computations."""

from __future__ import annotations

import pytest
from pdconnector.layout import (
    AttentionSpec,
    ConvLayout,
    KVModel,
    LayerKind,
    RankLayout,
    SsmFamily,
    SsmSpec,
    group_layers,
    model_from_hf_config,
    plan_transfer,
    transfer_volume,
)
from pdconnector.layout.known_models import NEMOTRON_NANO_9B_V2


def test_nemotron_h_conv_state_page_and_padding_match_the_hand_computation() -> None:
    model = model_from_hf_config(NEMOTRON_NANO_9B_V2)
    assert model.num_ssm_layers == 27 and model.num_attention_layers == 4
    rank = RankLayout(model, tp_size=1, tp_rank=0, num_blocks=8)
    # Conv channels: x = 128 heads x 80 = 10240, B = C = 8 groups x 128 state = 1024 each -> 12288.
    # Conv state keeps conv_kernel - 1 = 3 columns of bf16 (2 B): 12288 x 3 x 2 = 73,728 B per block,
    # as three runs: x 10240 x 6 = 61,440 B, B and C 1024 x 6 = 6,144 B each.
    assert rank.ssm_conv_bytes == 73_728
    assert rank.ssm_schema.sizes.tolist() == [61_440, 6_144, 6_144, 5_242_880]
    # Temporal state: 128 heads x 80 x 128 state in float32: 5,242,880 B. Real SSM page: 5,316,608 B.
    assert rank.ssm_state_bytes == 5_316_608
    # Attention per token per layer: 8 KV heads x (K + V) x 128 x 2 B = 4,096 B. vLLM picks the
    # smallest multiple of 16 tokens whose page covers the SSM page: 16 x ceil(5,316,608 / 65,536) = 16 x 82.
    assert model.block_size == 1312
    assert rank.attention_page_bytes == rank.page_bytes == 1312 * 4096 == 5_373_952
    # HMA pads every SSM page to the attention page: 57,344 B per Mamba layer per request.
    assert rank.ssm_padding_bytes == 57_344
    # 27 Mamba layers x 57,344 B = 1,548,288 B the naive whole-page transfer wastes per request.
    volume = transfer_volume(model, 4096)
    assert volume.ssm_naive - volume.ssm_optimal == 27 * 57_344 == 1_548_288
    # The planner moves exactly the real bytes: one SSM block per Mamba layer, no padding.
    groups = rank.groups
    assert [g.kind for g in groups] == [LayerKind.SSM] * 7 + [LayerKind.ATTENTION]
    src = [[g.index] for g in groups]
    plan = plan_transfer(rank, rank, src, src)
    ssm_bytes = plan.nbytes - 4 * rank.attention_page_bytes
    assert ssm_bytes == 27 * 5_316_608
    assert plan.naive_nbytes - plan.nbytes == 1_548_288


def test_nemotron_h_at_tp4_shards_every_sub_projection_and_keeps_engine_wide_padding() -> None:
    model = model_from_hf_config(NEMOTRON_NANO_9B_V2)
    rank = RankLayout(model, tp_size=4, tp_rank=2, num_blocks=8)
    # Each rank keeps a quarter of every run: x 15,360 B, B = C 1,536 B, temporal 1,310,720 B.
    assert rank.ssm_schema.sizes.tolist() == [15_360, 1_536, 1_536, 1_310_720]
    assert rank.ssm_schema.offsets.tolist() == [0, 15_360, 16_896, 18_432]
    assert rank.ssm_padding_bytes * 4 == 57_344
    assert (
        transfer_volume(model, 1024, tp_size=4).ssm_naive
        - transfer_volume(model, 1024, tp_size=4).ssm_optimal
        == 1_548_288
    )


def test_bf16_ssm_cache_gives_a_smaller_block_with_the_same_padding() -> None:
    model = model_from_hf_config(
        {**NEMOTRON_NANO_9B_V2, "mamba_ssm_cache_dtype": None}, ssm_state_dtype_bytes=2
    )
    rank = RankLayout(model, 1, 0, 4)
    # temporal 2,621,440 + conv 73,728 = 2,695,168 B; 16 x ceil(2,695,168 / 65,536) = 672 tokens.
    assert rank.ssm_state_bytes == 2_695_168
    assert model.block_size == 672
    assert rank.page_bytes == 2_752_512 and rank.ssm_padding_bytes == 57_344


def test_hma_groups_cut_layers_by_the_smallest_kind_and_share_one_region_per_slot() -> None:
    # 4 attention and 27 Mamba layers: group size 4, Mamba in 7 groups (the last of 3 layers).
    model = model_from_hf_config(NEMOTRON_NANO_9B_V2)
    groups = group_layers(model.layers)
    assert [len(g.layers) for g in groups] == [4, 4, 4, 4, 4, 4, 3, 4]
    mamba = [i for i, kind in enumerate(model.layers) if kind is LayerKind.SSM]
    assert groups[0].layers == tuple(mamba[0::7]) and groups[6].layers == tuple(mamba[6::7])
    rank = RankLayout(model, 1, 0, 10)
    assert len(rank.regions) == 4
    # every KV layer has a region; a region holds one layer of each group (one Mamba slot stays empty)
    assert sorted(rank.layer_slots) == list(range(31))
    per_region = [
        sorted(layer for layer, r in rank.layer_slots.items() if r == region) for region in range(4)
    ]
    assert [len(layers) for layers in per_region] == [8, 8, 8, 7]
    assert per_region[0] == sorted(g.layers[0] for g in groups)
    assert all(r.nbytes == 10 * rank.page_bytes for r in rank.regions)
    # Counts within 1.5x of each other: the larger count is the group size (attention padded to 4 slots).
    mixed = group_layers((LayerKind.ATTENTION,) * 3 + (LayerKind.SSM,) * 4)
    assert [(g.kind, g.layers) for g in mixed] == [
        (LayerKind.ATTENTION, (0, 1, 2)),
        (LayerKind.SSM, (3, 4, 5, 6)),
    ]


def test_dense_llama_has_one_group_and_one_region_per_layer_without_padding() -> None:
    model = model_from_hf_config(
        {
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "hidden_size": 128,
            "torch_dtype": "float32",
        }
    )
    assert model.block_size == 16 and model.attention == AttentionSpec(2, 32, 4)
    rank = RankLayout(model, 2, 1, 5)
    assert len(rank.groups) == 1 and len(rank.regions) == 2
    assert rank.page_bytes == 16 * 1 * 2 * 32 * 4 and rank.ssm_padding_bytes == 0


def test_gdn_hybrid_from_layer_types() -> None:
    config = {
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "hidden_size": 2048,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "torch_dtype": "bfloat16",
    }
    model = model_from_hf_config(config)
    assert model.ssm is not None and model.ssm.family is SsmFamily.GDN
    rank = RankLayout(model, 2, 0, 4)
    # Q = K = 16 x 128 channels, V = 32 x 128, halved by TP 2, 3 columns of 2 B; state 16 x 128 x 128 x 2 B.
    assert rank.ssm_schema.sizes.tolist() == [6_144, 6_144, 12_288, 524_288]


def test_conv_layout_sd_interleaves_sub_projections_per_row() -> None:
    ssm = SsmSpec.mamba2(
        num_heads=4,
        head_dim=2,
        n_groups=2,
        state_size=3,
        conv_kernel=3,
        conv_dtype_bytes=2,
        state_dtype_bytes=4,
        conv_layout=ConvLayout.SD,
    )
    rank = RankLayout(KVModel((LayerKind.SSM,), 16, None, ssm), 2, 0, 2)
    # two rows of [x (2 heads x 2), B (1 group x 3), C (1 x 3)] x 2 B, then the temporal state 2 x 2 x 3 x 4 B
    assert rank.ssm_schema.sizes.tolist() == [8, 6, 6, 8, 6, 6, 48]
    assert rank.page_bytes == rank.ssm_state_bytes == 88


def test_invalid_descriptions_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="num_kv_heads must be a positive integer"):
        AttentionSpec(0, 4, 2)
    with pytest.raises(ValueError, match="kernel_block_size 5 must divide block_size 16"):
        KVModel((LayerKind.ATTENTION,), 16, AttentionSpec(2, 4, 2), None, 5)
    with pytest.raises(ValueError, match=r"KVModel\.ssm is required"):
        KVModel((LayerKind.SSM,), 16, AttentionSpec(2, 4, 2))
    with pytest.raises(ValueError, match="HF config field 'mamba_head_dim' must be a positive integer"):
        model_from_hf_config({**NEMOTRON_NANO_9B_V2, "mamba_head_dim": None})
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        model_from_hf_config({**NEMOTRON_NANO_9B_V2, "torch_dtype": "int3"})
    model = model_from_hf_config(NEMOTRON_NANO_9B_V2)
    with pytest.raises(ValueError, match=r"attention num_kv_heads \(8\) is not divisible by tp_size 3"):
        RankLayout(model, 3, 0, 4)
    dense = KVModel((LayerKind.ATTENTION,), 16, model.attention)
    with pytest.raises(
        ValueError, match=r"tp_size 12 is above the attention num_kv_heads \(8\) and not a multiple"
    ):
        RankLayout(dense, 12, 0, 4)
    mamba_only = KVModel((LayerKind.SSM,), 16, None, model.ssm)
    with pytest.raises(
        ValueError, match=r"mamba2 conv projection B units \(8\) is not divisible by tp_size 16"
    ):
        RankLayout(mamba_only, 16, 0, 4)
    with pytest.raises(ValueError, match=r"tp_rank 2 must lie in \[0, tp_size=2\)"):
        RankLayout(model, 2, 2, 4)
    small = KVModel(model.layers, 16, model.attention, model.ssm)
    with pytest.raises(ValueError, match="smaller than the SSM state"):
        RankLayout(small, 1, 0, 4)
