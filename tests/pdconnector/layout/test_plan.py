"""Descriptor planning: properties over random layouts, a pool simulation against an independently
built reference of TP-sharded tensors, and errors for requests the planner must refuse."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pdconnector.layout import (
    AttentionLayout,
    AttentionSpec,
    BlockPlacement,
    ConvLayout,
    KVModel,
    LayerKind,
    RankLayout,
    SsmFamily,
    SsmSpec,
    TransferPlan,
    allocate_pools,
    apply_plan,
    expected_notifications,
    plan_transfer,
    targets_for,
    write_tagged_blocks,
    writers_for,
)

TPS = (1, 2, 4)
REGION_SPACING = 1 << 40


# ---------------------------------------------------------------------------------------------
# Random layouts and requests


def _ssm_spec(draw: st.DrawFn, family: SsmFamily) -> SsmSpec:
    conv_kernel = draw(st.sampled_from((2, 3, 4)))
    conv_bytes = draw(st.sampled_from((1, 2)))
    state_bytes = draw(st.sampled_from((2, 4)))
    conv_layout = draw(st.sampled_from(tuple(ConvLayout)))
    common = {
        "conv_kernel": conv_kernel,
        "conv_dtype_bytes": conv_bytes,
        "state_dtype_bytes": state_bytes,
        "conv_layout": conv_layout,
    }
    if family is SsmFamily.MAMBA2:
        return SsmSpec.mamba2(
            num_heads=draw(st.sampled_from((4, 8))),
            head_dim=draw(st.sampled_from((1, 2))),
            n_groups=4,
            state_size=draw(st.sampled_from((1, 2))),
            **common,
        )
    if family is SsmFamily.GDN:
        return SsmSpec.gdn(
            num_k_heads=4,
            num_v_heads=draw(st.sampled_from((4, 8))),
            head_k_dim=draw(st.sampled_from((1, 2))),
            head_v_dim=draw(st.sampled_from((1, 3))),
            **common,
        )
    return SsmSpec.mamba1(
        intermediate_size=draw(st.sampled_from((4, 12))), state_size=draw(st.sampled_from((1, 3))), **common
    )


@st.composite
def models(draw: st.DrawFn, family: str | None = None) -> KVModel:
    family = family or draw(st.sampled_from(("attention", "mamba2", "gdn", "mamba1")))
    has_attention = family == "attention" or draw(st.booleans())
    attention = ssm = None
    kinds = []
    if has_attention:
        attention = AttentionSpec(
            num_kv_heads=draw(st.sampled_from((1, 2, 4, 8))),  # 1 and 2: TP 4 replicates heads
            head_dim=draw(st.sampled_from((1, 2, 3))),
            dtype_bytes=draw(st.sampled_from((1, 2))),
            layout=draw(st.sampled_from(tuple(AttentionLayout))),
        )
        kinds.append(LayerKind.ATTENTION)
    if family != "attention":
        ssm = _ssm_spec(draw, SsmFamily(family))
        kinds.append(LayerKind.SSM)
    extra = draw(st.lists(st.sampled_from(kinds), max_size=4))
    layers = tuple(draw(st.permutations([*kinds, *extra])))
    if attention is None:
        block_size = draw(st.sampled_from((4, 16)))
        return KVModel(layers, block_size, None, ssm)
    kernel_block = draw(st.sampled_from((1, 2, 3)))
    unit = kernel_block * draw(st.sampled_from((1, 2, 3)))
    needed = 1
    if ssm is not None:
        needed = -(-sum(s.nbytes for s in ssm.segments) // (unit * attention.bytes_per_token))
    block_size = unit * (max(needed, 1) + draw(st.sampled_from((0, 1))))
    return KVModel(layers, block_size, attention, ssm, kernel_block)


@dataclass(frozen=True)
class Case:
    model: KVModel
    p_tp: int
    d_tp: int
    p_blocks: int
    d_blocks: int
    src: tuple[tuple[int, ...], ...]
    dst: tuple[tuple[int, ...], ...]
    num_tokens: int | None
    p_placement: BlockPlacement = BlockPlacement.LAYER_OUTER
    d_placement: BlockPlacement = BlockPlacement.LAYER_OUTER

    def layouts(self, tp: int, num_blocks: int, placement: BlockPlacement) -> list[RankLayout]:
        return [RankLayout(self.model, tp, r, num_blocks, placement) for r in range(tp)]

    @property
    def prefill(self) -> list[RankLayout]:
        return self.layouts(self.p_tp, self.p_blocks, self.p_placement)

    @property
    def decode(self) -> list[RankLayout]:
        return self.layouts(self.d_tp, self.d_blocks, self.d_placement)

    def plan(self, p: RankLayout, d: RankLayout, *, merge: bool = True) -> TransferPlan:
        return plan_transfer(p, d, self.src, self.dst, num_tokens=self.num_tokens, merge=merge)

    def tagged_prefill_pools(self) -> list[list[np.ndarray]]:
        """Each prefill rank's pools, its blocks of the request tagged (the rest a fill byte)."""
        out = []
        for p in self.prefill:
            pools = allocate_pools(p, fill=0x5A)
            write_tagged_blocks(p, pools, self.src, self.src)
            out.append(pools)
        return out


def _block_ids(draw: st.DrawFn, num_blocks: int, counts: list[int]) -> tuple[tuple[int, ...], ...]:
    total = sum(counts)
    if draw(st.booleans()):
        start = draw(st.integers(0, num_blocks - total))
        ids = list(range(start, start + total))
    else:
        ids = draw(st.permutations(range(num_blocks)))[:total]
    bounds = np.cumsum([0, *counts])
    return tuple(tuple(ids[a:b]) for a, b in itertools.pairwise(bounds.tolist()))


@st.composite
def cases(draw: st.DrawFn, family: str | None = None) -> Case:
    model = draw(models(family))
    p_tp, d_tp = draw(st.sampled_from(TPS)), draw(st.sampled_from(TPS))
    if model.ssm is not None and model.ssm.family is SsmFamily.MAMBA1:
        d_tp = p_tp
    groups = RankLayout(model, 1, 0, 1).groups
    attention_blocks = draw(st.integers(1, 3))
    counts = [attention_blocks if g.kind is LayerKind.ATTENTION else draw(st.integers(1, 2)) for g in groups]
    p_blocks, d_blocks = (
        draw(st.integers(sum(counts), sum(counts) + 6)),
        draw(st.integers(sum(counts), sum(counts) + 6)),
    )
    num_tokens = None
    if model.num_attention_layers and draw(st.booleans()):
        num_tokens = draw(
            st.integers((attention_blocks - 1) * model.block_size + 1, attention_blocks * model.block_size)
        )
    placements = st.sampled_from(placements_for(model))
    src, dst = _block_ids(draw, p_blocks, counts), _block_ids(draw, d_blocks, counts)
    return Case(
        model, p_tp, d_tp, p_blocks, d_blocks, src, dst, num_tokens, draw(placements), draw(placements)
    )


def placements_for(model: KVModel) -> list[BlockPlacement]:
    """What vLLM can build for the model: block-outer caches are never split into kernel blocks, head-outer
    ones hold head-major attention only."""
    if model.physical_blocks_per_logical != 1:
        return [BlockPlacement.LAYER_OUTER]
    head_major = model.attention is not None and model.attention.layout is AttentionLayout.PACKED_HND
    return (
        list(BlockPlacement)
        if head_major and not model.num_ssm_layers
        else [BlockPlacement.LAYER_OUTER, BlockPlacement.BLOCK_OUTER]
    )


# ---------------------------------------------------------------------------------------------
# Byte-level views of plans


def page_positions(layout: RankLayout, kind: LayerKind, slot: int, unit: int) -> tuple[int, np.ndarray]:
    """(region, byte offsets) of the real bytes of one unit's page, in page order, from the placements'
    definitions (vLLM's [L, B, ...], [B, L, H, ...] and [B, H, L, ...] orders)."""
    nbytes = (layout.attention_schema if kind is LayerKind.ATTENTION else layout.ssm_schema).nbytes
    page = layout.page_bytes
    if layout.placement is BlockPlacement.LAYER_OUTER:
        stride = layout.physical_page_bytes if kind is LayerKind.ATTENTION else page
        return slot, unit * stride + np.arange(nbytes)
    block = unit * layout.num_slots * page
    if layout.placement is BlockPlacement.BLOCK_OUTER:
        return 0, block + slot * page + np.arange(nbytes)
    head = nbytes // layout.kv_heads_per_rank
    heads = np.arange(nbytes // head)[:, None]
    return 0, (block + (heads * layout.num_slots + slot) * head + np.arange(head)[None, :]).ravel()


def requested_units(
    layout: RankLayout, group_kind: LayerKind, blocks: tuple[int, ...], num_tokens: int | None
) -> list[int]:
    """The units (kernel blocks for attention, logical blocks for SSM) of a group's blocks that hold state."""
    if group_kind is LayerKind.SSM:
        return list(blocks)
    model, ratio = layout.model, layout.model.physical_blocks_per_logical
    return [
        block * ratio + k
        for position, block in enumerate(blocks)
        for k in range(ratio)
        if num_tokens is None or (position * ratio + k) * model.kernel_block_size < num_tokens
    ]


def requested_bytes(
    layout: RankLayout, blocks: tuple[tuple[int, ...], ...], num_tokens: int | None
) -> list[np.ndarray]:
    """Per region, the bytes holding state of the requested blocks (padding and empty kernel blocks
    excluded)."""
    masks = [np.zeros(r.nbytes, dtype=bool) for r in layout.regions]
    for group in layout.groups:
        for slot in group.slots:
            for unit in requested_units(layout, group.kind, blocks[group.index], num_tokens):
                region, positions = page_positions(layout, group.kind, slot, unit)
                masks[region][positions] = True
    return masks


def byte_positions(region: np.ndarray, offset: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Every byte a plan side touches, as region * 2**40 + offset, in plan order."""
    total = int(length.sum())
    run_start = np.repeat(region.astype(np.int64) * REGION_SPACING + offset, length)
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(length) - length, length)
    return run_start + within


def byte_mapping(plan: TransferPlan) -> np.ndarray:
    pairs = np.stack(
        [
            byte_positions(plan.src_region, plan.src_offset, plan.length),
            byte_positions(plan.dst_region, plan.dst_offset, plan.length),
        ]
    )
    return pairs[:, np.lexsort(pairs[::-1])]


def touched(
    masks_shape: list[np.ndarray], region: np.ndarray, offset: np.ndarray, length: np.ndarray
) -> list[np.ndarray]:
    counts = [np.zeros(m.size, dtype=np.int64) for m in masks_shape]
    positions = byte_positions(region, offset, length)
    for r, count in enumerate(counts):
        mine = positions[positions // REGION_SPACING == r] % REGION_SPACING
        np.add.at(count, mine, 1)
    return counts


# ---------------------------------------------------------------------------------------------
# Properties


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_destination_byte_of_the_request_is_written_exactly_once_from_inside_registered_regions(
    case: Case,
) -> None:
    prefill, decode = case.prefill, case.decode
    for d in decode:
        want = requested_bytes(d, case.dst, case.num_tokens)
        written = [np.zeros(m.size, dtype=np.int64) for m in want]
        writers = []
        for p in prefill:
            plan = case.plan(p, d)
            assert plan.src_region.dtype == np.int32 and plan.dst_region.dtype == np.int32
            assert plan.src_offset.dtype == plan.dst_offset.dtype == plan.length.dtype == np.int64
            if len(plan) == 0:
                assert plan.nbytes == 0
                continue
            writers.append(p.tp_rank)
            assert (plan.length > 0).all()
            for side, layout, region, offset in (
                ("src", p, plan.src_region, plan.src_offset),
                ("dst", d, plan.dst_region, plan.dst_offset),
            ):
                sizes = np.asarray(layout.region_nbytes)
                assert (region >= 0).all() and (region < sizes.size).all(), side
                assert (offset >= 0).all() and (offset + plan.length <= sizes[region]).all(), side
            src_touch = touched(
                requested_bytes(p, case.src, case.num_tokens), plan.src_region, plan.src_offset, plan.length
            )
            for count, mask in zip(src_touch, requested_bytes(p, case.src, case.num_tokens), strict=True):
                assert not count[~mask].any(), (
                    "a source byte outside the requested state (padding or another block) is read"
                )
            for region, count in enumerate(touched(want, plan.dst_region, plan.dst_offset, plan.length)):
                written[region] += count
        # Of the ranks that pair with d, one holding a replicated head sends it and its replicas send nothing
        # (they still notify).
        assert set(writers) <= set(writers_for(d.tp_rank, case.p_tp, case.d_tp))
        assert len(writers_for(d.tp_rank, case.p_tp, case.d_tp)) == expected_notifications(
            case.p_tp, case.d_tp
        )
        for count, mask in zip(written, want, strict=True):
            np.testing.assert_array_equal(count, mask.astype(np.int64))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_merged_and_unmerged_plans_move_the_same_bytes_to_the_same_places(case: Case) -> None:
    for p, d in itertools.product(case.prefill, case.decode):
        unmerged, merged = case.plan(p, d, merge=False), case.plan(p, d)
        assert len(merged) <= len(unmerged)
        assert merged.nbytes == unmerged.nbytes
        assert merged.naive_nbytes == unmerged.naive_nbytes >= merged.nbytes
        np.testing.assert_array_equal(byte_mapping(merged), byte_mapping(unmerged))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_tagged_pools_land_byte_exact_for_random_layouts(case: Case) -> None:
    prefill_pools = case.tagged_prefill_pools()
    for d in case.decode:
        actual = allocate_pools(d, fill=0xC3)
        expected = allocate_pools(d, fill=0xC3)
        write_tagged_blocks(d, expected, case.dst, case.src, num_tokens=case.num_tokens)
        for p in case.prefill:
            apply_plan(case.plan(p, d), prefill_pools[p.tp_rank], actual)
        for got, want in zip(actual, expected, strict=True):
            np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# Simulation against an independent reference: the logical tensors as numpy arrays, sharded by TP


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def _shard(array: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s rows; with fewer rows than ranks, its replica of one row (vLLM's KV heads)."""
    rows = max(1, array.shape[0] // tp)
    first = rank // max(1, tp // array.shape[0]) * rows
    return array[first : first + rows]


def reference_attention_page(
    spec: AttentionSpec, tokens: int, tp: int, rank: int, seed: tuple[int, ...]
) -> bytes:
    """K and V of shape (heads, tokens, head_dim, dtype bytes), head-sharded, in the layout's byte order."""
    rng = np.random.default_rng(seed)
    k = _shard(_rand(rng, spec.num_kv_heads, tokens, spec.head_dim, spec.dtype_bytes), tp, rank)
    v = _shard(_rand(rng, spec.num_kv_heads, tokens, spec.head_dim, spec.dtype_bytes), tp, rank)
    kv = np.stack([k, v])  # (2, H, N, D, b)
    order = {
        AttentionLayout.PACKED_HND: (1, 2, 0, 3, 4),
        AttentionLayout.PACKED_NHD: (2, 1, 0, 3, 4),
        AttentionLayout.SPLIT_NHD: (0, 2, 1, 3, 4),
        AttentionLayout.SPLIT_HND: (0, 1, 2, 3, 4),
    }[spec.layout]
    return np.ascontiguousarray(kv.transpose(order)).tobytes()


def reference_ssm_page(spec: SsmSpec, tp: int, rank: int, seed: tuple[int, ...]) -> bytes:
    """Conv state: each sub-projection (channels, kernel-1, bytes) sharded by channel and the shards
    concatenated (column-parallel in_proj), stored (dim, kernel-1) for DS or transposed for SD;
    then the temporal state sharded along its first axis."""
    rng = np.random.default_rng(seed)
    parts = [
        _shard(_rand(rng, p.dim, spec.conv_rows, spec.conv_dtype_bytes), tp, rank) for p in spec.projections
    ]
    conv = np.concatenate(parts)  # (dim_local, rows, b)
    if spec.conv_layout is ConvLayout.SD:
        conv = conv.transpose(1, 0, 2)
    temporal = _shard(_rand(rng, *spec.state_shape, spec.state_dtype_bytes), tp, rank)
    return np.ascontiguousarray(conv).tobytes() + np.ascontiguousarray(temporal).tobytes()


def fill_reference(
    layout: RankLayout,
    pools: list[np.ndarray],
    blocks: tuple[tuple[int, ...], ...],
    tags,
    num_tokens: int | None,
) -> None:
    model = layout.model
    ratio = model.physical_blocks_per_logical
    for group in layout.groups:
        for slot in group.slots:
            for position, (block, tag) in enumerate(zip(blocks[group.index], tags[group.index], strict=True)):
                if group.kind is LayerKind.ATTENTION:
                    for k in range(ratio):
                        if (
                            num_tokens is not None
                            and (position * ratio + k) * model.kernel_block_size >= num_tokens
                        ):
                            continue
                        assert model.attention is not None
                        page = reference_attention_page(
                            model.attention,
                            model.kernel_block_size,
                            layout.tp_size,
                            layout.tp_rank,
                            (0, slot, tag, k),
                        )
                        region, positions = page_positions(layout, group.kind, slot, block * ratio + k)
                        pools[region][positions] = np.frombuffer(page, dtype=np.uint8)
                else:
                    assert model.ssm is not None
                    page = reference_ssm_page(model.ssm, layout.tp_size, layout.tp_rank, (1, slot, tag))
                    region, positions = page_positions(layout, group.kind, slot, block)
                    pools[region][positions] = np.frombuffer(page, dtype=np.uint8)


def run_simulation(case: Case) -> None:
    rng = np.random.default_rng(7)
    prefill_pools = []
    for p in case.prefill:
        pools = [_rand(rng, r.nbytes) for r in p.regions]
        fill_reference(p, pools, case.src, case.src, None)
        prefill_pools.append(pools)
    for d in case.decode:
        initial = [_rand(rng, r.nbytes) for r in d.regions]
        actual = [pool.copy() for pool in initial]
        expected = [pool.copy() for pool in initial]
        fill_reference(d, expected, case.dst, case.src, case.num_tokens)
        for p in case.prefill:
            apply_plan(case.plan(p, d), prefill_pools[p.tp_rank], actual)
        for region, (got, want) in enumerate(zip(actual, expected, strict=True)):
            np.testing.assert_array_equal(got, want, err_msg=f"decode rank {d.tp_rank} region {region}")


HYBRIDS = {
    "attention": (None, AttentionLayout.PACKED_HND),
    "attention-legacy-flash": (None, AttentionLayout.SPLIT_NHD),
    "mamba2": (
        SsmSpec.mamba2(
            num_heads=8,
            head_dim=4,
            n_groups=4,
            state_size=4,
            conv_kernel=4,
            conv_dtype_bytes=2,
            state_dtype_bytes=4,
        ),
        None,
    ),
    "mamba2-sd": (
        SsmSpec.mamba2(
            num_heads=8,
            head_dim=4,
            n_groups=4,
            state_size=4,
            conv_kernel=4,
            conv_dtype_bytes=2,
            state_dtype_bytes=4,
            conv_layout=ConvLayout.SD,
        ),
        None,
    ),
    "gdn": (
        SsmSpec.gdn(
            num_k_heads=4,
            num_v_heads=8,
            head_k_dim=4,
            head_v_dim=6,
            conv_kernel=4,
            conv_dtype_bytes=2,
            state_dtype_bytes=4,
        ),
        None,
    ),
    "mamba1": (
        SsmSpec.mamba1(
            intermediate_size=16, state_size=4, conv_kernel=4, conv_dtype_bytes=2, state_dtype_bytes=4
        ),
        None,
    ),
}


def _hybrid_case(name: str, p_tp: int, d_tp: int) -> Case:
    ssm, layout = HYBRIDS[name]
    attention = AttentionSpec(
        num_kv_heads=4, head_dim=8, dtype_bytes=2, layout=layout or AttentionLayout.PACKED_HND
    )
    kernel_block = 4
    if ssm is None:
        model = KVModel((LayerKind.ATTENTION,) * 3, 8, attention, None, kernel_block)
        src, dst = ((3, 4, 5),), ((9, 2, 0),)
    else:
        layers = (
            LayerKind.SSM,
            LayerKind.SSM,
            LayerKind.ATTENTION,
            LayerKind.SSM,
            LayerKind.SSM,
            LayerKind.ATTENTION,
        )
        needed = -(-sum(s.nbytes for s in ssm.segments) // (2 * kernel_block * attention.bytes_per_token))
        model = KVModel(layers, 2 * kernel_block * needed, attention, ssm, kernel_block)
        # groups: ssm (layers 0, 3), ssm (1, 4), attention (2, 5)
        src, dst = ((7,), (2,), (3, 4, 5)), ((1,), (6,), (8, 9, 3))
    return Case(model, p_tp, d_tp, 10, 11, src, dst, num_tokens=None)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_random_layouts_deliver_each_decode_rank_its_shard_of_the_reference_tensors(case: Case) -> None:
    run_simulation(case)


SUPPORTED_PAIRS = [
    (name, p_tp, d_tp)
    for name in HYBRIDS
    for p_tp, d_tp in itertools.product(TPS, TPS)
    if name != "mamba1" or p_tp == d_tp  # mamba1 is planned for equal TP only; its refusal is tested below
]


@pytest.mark.parametrize(("name", "p_tp", "d_tp"), SUPPORTED_PAIRS)
def test_each_decode_rank_holds_exactly_its_shard_of_the_prefill_engines_state(
    name: str, p_tp: int, d_tp: int
) -> None:
    run_simulation(_hybrid_case(name, p_tp, d_tp))


def test_the_simulation_fails_when_a_decode_rank_receives_another_ranks_shard() -> None:
    case = _hybrid_case("mamba2", 1, 2)
    original_plan = Case.plan

    def swapped(self: Case, p: RankLayout, d: RankLayout, *, merge: bool = True) -> TransferPlan:
        return original_plan(
            self, p, RankLayout(d.model, d.tp_size, 1 - d.tp_rank, d.num_blocks, d.placement), merge=merge
        )

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Case, "plan", swapped)
        with pytest.raises(AssertionError):
            run_simulation(case)


def test_trimmed_attention_leaves_the_empty_tail_of_the_last_logical_block_untouched() -> None:
    case = _hybrid_case("mamba2", 2, 4)
    trimmed = Case(
        case.model,
        2,
        4,
        case.p_blocks,
        case.d_blocks,
        case.src,
        case.dst,
        num_tokens=2 * case.model.block_size + 3,
    )
    run_simulation(trimmed)
    moved = sum(trimmed.plan(p, d).nbytes for p in trimmed.prefill for d in trimmed.decode)
    assert moved < sum(case.plan(p, d).nbytes for p in case.prefill for d in case.decode)


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
