"""Descriptor planning: properties over random layouts and a pool simulation against an independently built
reference of TP-sharded tensors (exact shapes and refusals: ``test_plan_shapes``)."""

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
