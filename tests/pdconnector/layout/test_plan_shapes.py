"""Descriptor planning by example: the exact runs of known layouts, who writes where, and the requests the
planner must refuse."""

from __future__ import annotations

import numpy as np
import pytest
from pdconnector.layout import (
    AttentionLayout,
    AttentionSpec,
    BlockPlacement,
    KVModel,
    LayerKind,
    RankLayout,
    SsmSpec,
    expected_notifications,
    plan_transfer,
    targets_for,
    writers_for,
)

# ---------------------------------------------------------------------------------------------
# Exact shapes of the plan


def _nemotron_like(kernel_block: int = 16, ratio: int = 1) -> KVModel:
    attention = AttentionSpec(num_kv_heads=8, head_dim=128, dtype_bytes=2)
    ssm = SsmSpec.mamba2(
        num_heads=128,
        head_dim=80,
        n_groups=8,
        state_size=128,
        conv_kernel=4,
        conv_dtype_bytes=2,
        state_dtype_bytes=4,
    )
    layers = (LayerKind.SSM, LayerKind.ATTENTION) * 2
    return KVModel(layers, 1312, attention, ssm, 1312 // ratio if ratio > 1 else 1312)


def test_homogeneous_ssm_block_goes_as_one_descriptor_of_real_bytes_and_conv_as_three_before_merging() -> (
    None
):
    model = _nemotron_like()
    p, d = RankLayout(model, 2, 1, 8), RankLayout(model, 2, 1, 8)
    # groups: ssm (layers 0, 2), attention (1, 3)
    unmerged = plan_transfer(p, d, [[5], [1, 2]], [[0], [3, 4]], merge=False)
    # attention first: 2 regions x 2 blocks, then SSM: 2 regions x (x, B, C, temporal)
    assert len(unmerged) == 2 * 2 + 2 * 4
    assert unmerged.length[:4].tolist() == [p.attention_page_bytes] * 4
    # x = 64 heads x 80 x 3 rows x 2 B, B = C = 4 groups x 128 x 3 x 2 B, temporal = 64 x 80 x 128 x 4 B
    assert unmerged.length[4:8].tolist() == [30720, 3072, 3072, 2621440]
    merged = unmerged.merged()
    # consecutive attention blocks fuse per region; the SSM block fuses into one run of conv + temporal bytes
    assert merged.length.tolist() == [2 * p.attention_page_bytes] * 2 + [p.ssm_state_bytes] * 2
    assert merged.dst_offset.tolist() == [3 * p.page_bytes, 3 * p.page_bytes, 0, 0]


def test_decode_tp_above_prefill_tp_takes_its_slice_of_each_sub_projection() -> None:
    model = _nemotron_like()
    p, d = RankLayout(model, 1, 0, 4), RankLayout(model, 4, 3, 4)
    plan = plan_transfer(p, d, [[2], [1]], [[0], [3]], merge=False)
    ssm = slice(2, 6)  # attention: 2 regions x 1 block first
    x, b = 128 * 80 * 3 * 2, 8 * 128 * 3 * 2  # TP-1 conv bytes of x and of B (= C)
    # offset_k = ratio * sum_{j<k} s_j + (rank % ratio) * s_k with local sizes s = (x/4, b/4, b/4)
    assert plan.src_offset[ssm].tolist() == [
        2 * p.page_bytes + 3 * x // 4,
        2 * p.page_bytes + x + 3 * b // 4,
        2 * p.page_bytes + x + b + 3 * b // 4,
        2 * p.page_bytes + x + 2 * b + 3 * (128 * 80 * 128 * 4 // 4),
    ]
    assert plan.dst_offset[ssm].tolist() == [0, x // 4, x // 4 + b // 4, x // 4 + 2 * (b // 4)]
    # attention: the fourth quarter of the heads of prefill's block
    assert plan.src_offset[:2].tolist() == [1 * p.page_bytes + 3 * d.attention_page_bytes] * 2
    assert plan.length[:2].tolist() == [d.attention_page_bytes] * 2


def test_prefill_tp_above_decode_tp_fills_each_decode_sub_projection_in_chunks() -> None:
    model = _nemotron_like()
    d = RankLayout(model, 1, 0, 4)
    x_local = 128 * 80 * 3 * 2 // 4
    offsets = []
    for rank in range(4):
        plan = plan_transfer(RankLayout(model, 4, rank, 4), d, [[0], [1]], [[2], [3]], merge=False)
        offsets.append(int(plan.dst_offset[2]) - 2 * d.page_bytes)
        assert int(plan.src_offset[2]) == 0  # each prefill rank sends its whole x shard
    assert offsets == [rank * x_local for rank in range(4)]


def test_kernel_blocks_subdivide_logical_blocks_for_attention_only() -> None:
    model = _nemotron_like(ratio=41)  # 1312 = 41 x 32-token kernel blocks
    p = RankLayout(model, 1, 0, 4)
    assert model.physical_blocks_per_logical == 41 and p.physical_page_bytes * 41 == p.attention_page_bytes
    plan = plan_transfer(p, p, [[1], [2, 3]], [[0], [2, 3]], merge=False, num_tokens=1312 + 100)
    attention = plan.length.size - 2 * 4
    assert attention == 2 * (41 + 4)  # 2 regions x (one full logical block + ceil(100 / 32) kernel blocks)
    assert plan.dst_offset[41] == 3 * p.page_bytes
    merged = plan.merged()
    assert merged.length[:2].tolist() == [p.attention_page_bytes + 4 * p.physical_page_bytes] * 2


def _qwen_like(layers: int = 4, heads: int = 8) -> KVModel:
    return KVModel(
        (LayerKind.ATTENTION,) * layers, 16, AttentionSpec(num_kv_heads=heads, head_dim=128, dtype_bytes=2)
    )


SCATTERED = [[9, 2, 7, 4]]


@pytest.mark.parametrize(
    ("placement", "descriptors"),
    [(BlockPlacement.LAYER_OUTER, 4 * 4), (BlockPlacement.BLOCK_OUTER, 4), (BlockPlacement.HEAD_OUTER, 4)],
)
def test_block_outer_placements_move_a_scattered_block_of_every_layer_as_one_descriptor(
    placement: BlockPlacement, descriptors: int
) -> None:
    model = _qwen_like()
    p, d = RankLayout(model, 2, 1, 12, placement), RankLayout(model, 2, 1, 12, placement)
    plan = plan_transfer(p, d, SCATTERED, [[3, 11, 0, 5]])
    assert len(plan) == descriptors
    assert plan.nbytes == 4 * 4 * p.attention_page_bytes
    if placement is not BlockPlacement.LAYER_OUTER:
        assert plan.length.tolist() == [p.block_stride] * 4
        assert plan.dst_offset.tolist() == [b * d.block_stride for b in (3, 11, 0, 5)]


@pytest.mark.parametrize(
    ("placement", "descriptors"),
    [
        (BlockPlacement.LAYER_OUTER, 4 * 4),
        (BlockPlacement.BLOCK_OUTER, 4 * 4),
        (BlockPlacement.HEAD_OUTER, 4),
    ],
)
def test_head_outer_keeps_a_heterogeneous_tp_head_slice_of_every_layer_in_one_run(
    placement: BlockPlacement, descriptors: int
) -> None:
    """Decode TP 4 takes 2 of the 8 heads from a TP-1 prefill: per block, those heads of every layer sit
    together only when heads are outside layers (BHLNC); in BLHNC they are one run per layer."""
    model = _qwen_like()
    p, d = RankLayout(model, 1, 0, 12, placement), RankLayout(model, 4, 3, 12, placement)
    plan = plan_transfer(p, d, SCATTERED, [[3, 11, 0, 5]])
    assert len(plan) == descriptors
    assert plan.nbytes == 4 * 4 * d.attention_page_bytes
    if placement is BlockPlacement.HEAD_OUTER:
        # heads 6 and 7 of every layer: the last quarter of each prefill block
        assert plan.src_offset.tolist() == [
            b * p.block_stride + 3 * p.block_stride // 4 for b in SCATTERED[0]
        ]


def test_prefill_and_decode_may_place_blocks_differently() -> None:
    """A BLHNC prefill writing into an LBHNC decode: one run per layer per block, each at its own side's
    address."""
    model = _qwen_like(layers=2)
    p, d = RankLayout(model, 1, 0, 8, BlockPlacement.BLOCK_OUTER), RankLayout(model, 1, 0, 8)
    plan = plan_transfer(p, d, [[5]], [[2]])
    page = p.attention_page_bytes
    assert sorted(
        zip(plan.src_offset.tolist(), plan.dst_region.tolist(), plan.dst_offset.tolist(), strict=True)
    ) == [
        (5 * 2 * page, 0, 2 * page),
        (5 * 2 * page + page, 1, 2 * page),
    ]


def test_hybrid_block_outer_fuses_attention_layers_and_sends_each_ssm_slot_without_its_padding() -> None:
    model = _nemotron_like()
    p, d = (
        RankLayout(model, 2, 1, 8, BlockPlacement.BLOCK_OUTER),
        RankLayout(model, 2, 1, 8, BlockPlacement.BLOCK_OUTER),
    )
    assert len(p.regions) == 1 and p.block_stride == 2 * p.page_bytes
    # groups: ssm (layers 0, 2), attention (1, 3); both alias slots 0 and 1 of every block
    plan = plan_transfer(p, d, [[5], [1, 2]], [[0], [3, 4]])
    attention, ssm = plan.length[:1].tolist(), plan.length[1:].tolist()
    assert attention == [2 * p.block_stride]  # blocks 1, 2 -> 3, 4: both layers of both blocks in one run
    assert ssm == [p.ssm_state_bytes] * 2
    assert plan.nbytes == plan.naive_nbytes - 2 * p.ssm_padding_bytes


def test_placements_vllm_cannot_build_are_refused() -> None:
    with pytest.raises(ValueError, match="never splits them into kernel blocks"):
        RankLayout(_nemotron_like(ratio=41), 1, 0, 4, BlockPlacement.BLOCK_OUTER)
    with pytest.raises(ValueError, match="needs block_outer"):
        RankLayout(_nemotron_like(), 1, 0, 4, BlockPlacement.HEAD_OUTER)
    nhd = KVModel((LayerKind.ATTENTION,), 16, AttentionSpec(2, 8, 2, AttentionLayout.PACKED_NHD))
    with pytest.raises(ValueError, match="head-major"):
        RankLayout(nhd, 1, 0, 4, BlockPlacement.HEAD_OUTER)


def test_to_descriptors_adds_region_base_addresses() -> None:
    model = _nemotron_like()
    p = RankLayout(model, 1, 0, 4)
    plan = plan_transfer(p, p, [[1], [2]], [[3], [0]])
    src, dst = plan.to_descriptors([1000, 10**12], [5, 7 * 10**11])
    assert src.dtype == dst.dtype == np.int64 and src.shape == dst.shape == (len(plan), 3)
    assert (src[:, 2] == 0).all() and (src[:, 1] == plan.length).all()
    assert src[:, 0].tolist() == [
        [1000, 10**12][r] + o for r, o in zip(plan.src_region.tolist(), plan.src_offset.tolist(), strict=True)
    ]
    assert dst[:, 0].tolist() == [
        [5, 7 * 10**11][r] + o
        for r, o in zip(plan.dst_region.tolist(), plan.dst_offset.tolist(), strict=True)
    ]
    with pytest.raises(ValueError, match="dst_region_addrs"):
        plan.to_descriptors([1, 2], [3])


def test_descriptors_name_each_sides_device() -> None:
    """Rank 5 of a TP-8 prefill (cuda:5) writing into rank 2 of a decode (cuda:2): every row names its own
    side's device."""
    model = _nemotron_like()
    p = RankLayout(model, 1, 0, 4)
    plan = plan_transfer(p, p, [[1], [2]], [[3], [0]])
    src, dst = plan.to_descriptors([1000, 10**12], [5, 7 * 10**11], src_device_id=5, dst_device_id=2)
    assert (src[:, 2] == 5).all() and (dst[:, 2] == 2).all()
    assert src[:, :2].tolist() == plan.to_descriptors([1000, 10**12], [5, 7 * 10**11])[0][:, :2].tolist()
    with pytest.raises(ValueError, match="device id must be >= 0"):
        plan.to_descriptors([1, 2], [3, 4], dst_device_id=-1)


def test_naive_bytes_count_whole_pages_per_writer() -> None:
    model = _nemotron_like()
    for p_tp, d_tp in [(1, 1), (1, 2), (2, 1), (4, 2)]:
        plans = [
            plan_transfer(
                RankLayout(model, p_tp, p, 4), RankLayout(model, d_tp, d, 4), [[0], [1, 2]], [[3], [0, 1]]
            )
            for p in range(p_tp)
            for d in range(d_tp)
        ]
        d_page = RankLayout(model, d_tp, 0, 4).page_bytes
        assert sum(plan.naive_nbytes for plan in plans) == d_tp * d_page * 2 * 3
        assert (
            sum(plan.naive_nbytes - plan.nbytes for plan in plans)
            == d_tp * 2 * RankLayout(model, d_tp, 0, 4).ssm_padding_bytes
        )


# ---------------------------------------------------------------------------------------------
# Who writes where


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "decode_rank", "writers"),
    [(1, 1, 0, (0,)), (1, 4, 3, (0,)), (2, 4, 3, (1,)), (4, 1, 0, (0, 1, 2, 3)), (4, 2, 1, (2, 3))],
)
def test_writers_and_targets_are_inverse(
    p_tp: int, d_tp: int, decode_rank: int, writers: tuple[int, ...]
) -> None:
    assert writers_for(decode_rank, p_tp, d_tp) == writers
    assert expected_notifications(p_tp, d_tp) == len(writers)
    for p in writers:
        assert decode_rank in targets_for(p, p_tp, d_tp)


# ---------------------------------------------------------------------------------------------
# Refusals


def test_block_ids_out_of_range_are_refused_naming_the_group() -> None:
    p = RankLayout(_nemotron_like(), 1, 0, 4)
    with pytest.raises(ValueError, match=r"dst_blocks\[1\]: block id 4 out of range \[0, 4\)"):
        plan_transfer(p, p, [[0], [1]], [[0], [4]])
    with pytest.raises(ValueError, match=r"src_blocks\[0\]: block id -1"):
        plan_transfer(p, p, [[-1], [1]], [[0], [1]])


def test_mismatched_group_or_block_counts_are_refused() -> None:
    p = RankLayout(_nemotron_like(), 1, 0, 4)
    with pytest.raises(ValueError, match="expected block ids for 2 KV groups, got 1"):
        plan_transfer(p, p, [[0]], [[0], [1]])
    with pytest.raises(ValueError, match="KV group 1: 2 source blocks but 1 destination blocks"):
        plan_transfer(p, p, [[0], [1, 2]], [[0], [1]])
    with pytest.raises(ValueError, match="block id 1 is requested more than once"):
        plan_transfer(p, p, [[0], [1, 2]], [[1], [1, 2]])


def test_unsupported_tp_combinations_are_refused() -> None:
    with pytest.raises(ValueError, match="prefill TP 2 and decode TP 3 must divide one another"):
        writers_for(0, 2, 3)
    attention = AttentionSpec(num_kv_heads=6, head_dim=4, dtype_bytes=2)
    model = KVModel((LayerKind.ATTENTION,), 16, attention)
    with pytest.raises(ValueError, match="must divide one another"):
        plan_transfer(RankLayout(model, 2, 0, 4), RankLayout(model, 3, 0, 4), [[0]], [[0]])
    with pytest.raises(ValueError, match=r"num_kv_heads \(6\) is not divisible by tp_size 4"):
        RankLayout(model, 4, 0, 4)
    mamba1 = KVModel(
        (LayerKind.SSM,),
        16,
        None,
        SsmSpec.mamba1(
            intermediate_size=8, state_size=2, conv_kernel=4, conv_dtype_bytes=2, state_dtype_bytes=4
        ),
    )
    with pytest.raises(ValueError, match="mamba1 state transfer needs equal TP"):
        plan_transfer(RankLayout(mamba1, 1, 0, 4), RankLayout(mamba1, 2, 0, 4), [[0]], [[0]])


def test_different_models_are_refused() -> None:
    a = _nemotron_like()
    b = KVModel(a.layers, a.block_size * 2, a.attention, a.ssm)
    with pytest.raises(ValueError, match="models differ in block_size"):
        plan_transfer(RankLayout(a, 1, 0, 4), RankLayout(b, 1, 0, 4), [[0], [1]], [[0], [1]])


def test_num_tokens_beyond_the_given_blocks_is_refused() -> None:
    p = RankLayout(_nemotron_like(), 1, 0, 4)
    with pytest.raises(
        ValueError, match="num_tokens 1313 does not fit the 1 kernel blocks given for KV group 1"
    ):
        plan_transfer(p, p, [[0], [1]], [[0], [1]], num_tokens=1313)
