"""The descriptor-id view agrees with the plan and with upstream vLLM's id formulas."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pdconnector.layout import (
    AttentionLayout,
    AttentionSpec,
    ConvLayout,
    KVModel,
    LayerKind,
    RankLayout,
    SsmSpec,
    plan_transfer,
)
from pdconnector.layout.descriptors import descriptor_ids, descriptor_tables

LAYERS = (
    LayerKind.SSM,
    LayerKind.ATTENTION,
    LayerKind.SSM,
    LayerKind.SSM,
    LayerKind.ATTENTION,
    LayerKind.SSM,
)


def _model(attention_layout: AttentionLayout, conv_layout: ConvLayout, gdn: bool) -> KVModel:
    attention = AttentionSpec(num_kv_heads=4, head_dim=4, dtype_bytes=2, layout=attention_layout)
    if gdn:
        ssm = SsmSpec.gdn(
            num_k_heads=4,
            num_v_heads=8,
            head_k_dim=2,
            head_v_dim=2,
            conv_kernel=3,
            conv_dtype_bytes=2,
            state_dtype_bytes=4,
            conv_layout=conv_layout,
        )
    else:
        ssm = SsmSpec.mamba2(
            num_heads=8,
            head_dim=2,
            n_groups=4,
            state_size=2,
            conv_kernel=4,
            conv_dtype_bytes=2,
            state_dtype_bytes=4,
            conv_layout=conv_layout,
        )
    return KVModel(LAYERS, 16, attention, ssm, kernel_block_size=4)


MODELS = [_model(a, c, g) for a, c, g in itertools.product(AttentionLayout, ConvLayout, (False, True))]


@settings(max_examples=60, deadline=None)
@given(
    model=st.sampled_from(MODELS),
    tps=st.sampled_from(list(itertools.product((1, 2, 4), repeat=2))),
    order=st.permutations(range(12)),
    num_tokens=st.one_of(st.none(), st.integers(1, 32)),
)
def test_table_entries_at_the_request_ids_are_the_unmerged_plan(model, tps, order, num_tokens) -> None:
    p_tp, d_tp = tps
    groups = RankLayout(model, 1, 0, 12).groups  # ssm (0, 3), ssm (2, 5), attention (1, 4)
    counts = [2 if g.kind is LayerKind.ATTENTION else 1 for g in groups]
    bounds = list(itertools.accumulate([0, *counts]))
    src = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
    dst = [order[a:b] for a, b in itertools.pairwise(bounds)]
    for p, d in itertools.product(range(p_tp), range(d_tp)):
        src_layout, dst_layout = RankLayout(model, p_tp, p, 8), RankLayout(model, d_tp, d, 12)
        plan = plan_transfer(src_layout, dst_layout, src, dst, num_tokens=num_tokens, merge=False)
        src_table, dst_table = descriptor_tables(src_layout, dst_layout)
        src_ids, dst_ids = descriptor_ids(src_layout, dst_layout, src, dst, num_tokens=num_tokens)
        np.testing.assert_array_equal(src_table.region[src_ids], plan.src_region)
        np.testing.assert_array_equal(src_table.offset[src_ids], plan.src_offset)
        np.testing.assert_array_equal(dst_table.region[dst_ids], plan.dst_region)
        np.testing.assert_array_equal(dst_table.offset[dst_ids], plan.dst_offset)
        np.testing.assert_array_equal(src_table.length[src_ids], plan.length)
        np.testing.assert_array_equal(dst_table.length[dst_ids], plan.length)
        for table, layout in ((src_table, src_layout), (dst_table, dst_layout)):
            assert (table.offset + table.length <= np.asarray(layout.region_nbytes)[table.region]).all()


def test_same_tp_ids_follow_upstream_formulas() -> None:
    model = _model(AttentionLayout.PACKED_HND, ConvLayout.DS, gdn=False)
    rank = RankLayout(model, 2, 1, 10)
    n_phys, n_logical, regions = 10 * 4, 10, 2
    src_table, _ = descriptor_tables(rank, rank)
    assert src_table.num_attention_descs == regions * n_phys
    # groups: ssm (layers 0, 3), ssm (2, 5), attention (1, 4); attention blocks 7 -> kernel blocks 28..31
    src_ids, _ = descriptor_ids(rank, rank, [[3], [5], [7]], [[3], [5], [7]])
    attention = [r * n_phys + b for r in range(regions) for b in range(28, 32)]
    ssm = [
        regions * n_phys + (r * 4 + sub) * n_logical + block
        for block in (3, 5)
        for r in range(regions)
        for sub in range(4)
    ]
    assert src_ids.tolist() == attention + ssm
    # x, B, C and the temporal state of block 3, region 1, at the page offsets of the DS layout
    first = regions * n_phys + (1 * 4) * n_logical + 3
    entries = [
        (int(src_table.offset[first + sub * n_logical]), int(src_table.length[first + sub * n_logical]))
        for sub in range(4)
    ]
    x, b, temporal = 8 // 2 * 2 * 3 * 2, 4 // 2 * 2 * 3 * 2, 8 // 2 * 2 * 2 * 4
    page = 3 * rank.page_bytes
    assert entries == [(page, x), (page + x, b), (page + x + b, b), (page + x + 2 * b, temporal)]


def test_table_addresses_need_one_base_per_region() -> None:
    rank = RankLayout(MODELS[0], 1, 0, 4)
    table, _ = descriptor_tables(rank, rank)
    descs = table.to_descriptors([4096, 1 << 33])
    assert descs.shape == (len(table), 3) and descs[:, 2].max() == 0
    assert descs[0, 0] == 4096 and descs[-1, 0] == (1 << 33) + table.offset[-1]
    with pytest.raises(ValueError, match="expected 2 addresses, got 1"):
        table.to_descriptors([0])


def test_table_descriptors_carry_the_ranks_device() -> None:
    rank = RankLayout(MODELS[0], 1, 0, 4)
    table, _ = descriptor_tables(rank, rank)
    descs = table.to_descriptors([4096, 1 << 33], device_id=7)
    assert (descs[:, 2] == 7).all()
    assert descs[:, :2].tolist() == table.to_descriptors([4096, 1 << 33])[:, :2].tolist()
