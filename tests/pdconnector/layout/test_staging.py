"""The staged path: a plan as gathered rows in bounded chunks, and the cost model that picks it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from pdconnector.layout import (
    BlockPlacement,
    LayerKind,
    RankLayout,
    model_from_hf_config,
    plan_transfer,
)
from pdconnector.layout.known_models import QWEN3_32B
from pdconnector.layout.staging import (
    PathCosts,
    SlotCopy,
    TransferPath,
    choose_path,
    gather_copy,
    received_plan,
    scatter_copy,
    staging_cost_blocks,
)
from pdconnector.layout.synthetic import allocate_pools, apply_plan

from tests.pdconnector.layout.test_plan import Case, cases

MiB = 2**20
Pools = tuple[list[np.ndarray], list[np.ndarray]]


def copy_rows(copy: SlotCopy, regions: list[np.ndarray], slot: np.ndarray, *, into_slot: bool) -> None:
    """One side's indexed copy between its regions and the slot, with numpy as the device."""
    slot_rows = slot.reshape(-1, copy.row_bytes)
    for region, rows, slots in copy.by_region():
        pool = regions[region]
        pool_rows = pool[: pool.size // copy.row_bytes * copy.row_bytes].reshape(-1, copy.row_bytes)
        if into_slot:
            slot_rows[slots] = pool_rows[rows]
        else:
            pool_rows[rows] = slot_rows[slots]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_a_slot_gathered_by_the_source_and_scattered_by_the_destination_lands_like_the_direct_plan(
    case: Case,
) -> None:
    """The destination derives its scatter from its own blocks and the source's rank alone, never from the
    source's block ids, and still agrees with the source on every byte of the slot."""
    prefill_pools = case.tagged_prefill_pools()
    for d in case.decode:
        direct, staged = allocate_pools(d, fill=0xC3), allocate_pools(d, fill=0xC3)
        for p in case.prefill:
            plan = case.plan(p, d)
            apply_plan(plan, prefill_pools[p.tp_rank], direct)
            gather = gather_copy(plan)
            received = received_plan(d, p.tp_size, p.tp_rank, case.dst, num_tokens=case.num_tokens)
            scatter = scatter_copy(received)
            assert gather.nbytes == scatter.nbytes == plan.nbytes
            slot = np.zeros(plan.nbytes, dtype=np.uint8)
            copy_rows(gather, prefill_pools[p.tp_rank], slot, into_slot=True)
            copy_rows(scatter, staged, slot, into_slot=False)
        for got, want in zip(staged, direct, strict=True):
            np.testing.assert_array_equal(got, want)


def test_slot_copies_use_rows_as_large_as_the_runs_allow() -> None:
    model = model_from_hf_config(QWEN3_32B, block_size=16)
    p = d = RankLayout(model, 8, 0, 64, BlockPlacement.BLOCK_OUTER)
    plan = plan_transfer(p, d, [[5, 9, 2]], [[7, 1, 3]])
    gather, scatter = gather_copy(plan), scatter_copy(plan)
    # a row is a block of every layer
    assert gather.row_bytes == scatter.row_bytes == p.page_bytes * p.num_slots
    np.testing.assert_array_equal(scatter.region_row, [1, 3, 7])  # the slot is in destination order
    np.testing.assert_array_equal(scatter.slot_row, [0, 1, 2])
    np.testing.assert_array_equal(gather.region_row, [9, 2, 5])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_each_side_covers_the_plan_once_in_rows_that_divide_its_runs(case: Case) -> None:
    for p, d in itertools.product(case.prefill, case.decode):
        plan = case.plan(p, d)
        for copy, region, offset in (
            (gather_copy(plan), plan.src_region, plan.src_offset),
            (scatter_copy(plan), plan.dst_region, plan.dst_offset),
        ):
            assert copy.nbytes == plan.nbytes
            assert np.all(offset % copy.row_bytes == 0) and np.all(plan.length % copy.row_bytes == 0)
            # every slot row once, and no region row twice: a row is the unit every run is cut into
            assert sorted(copy.slot_row.tolist()) == list(range(copy.region.size))
            assert (
                len(set(zip(copy.region.tolist(), copy.region_row.tolist(), strict=True))) == copy.region.size
            )
            assert set(copy.region.tolist()) <= set(region.tolist())


def qwen_rank(tokens: int) -> tuple[RankLayout, list[list[int]]]:
    model = model_from_hf_config(QWEN3_32B, block_size=16)
    layout = RankLayout(model, 8, 0, 4 * tokens // 16, BlockPlacement.BLOCK_OUTER)
    return layout, [np.random.default_rng(7).permutation(layout.num_blocks)[: tokens // 16].tolist()]


def test_a_scattered_block_outer_request_stages_as_one_row_per_block_in_the_destinations_order() -> None:
    layout, blocks = qwen_rank(16_384)
    order = np.random.default_rng(8).permutation(blocks[0]).tolist()
    plan = plan_transfer(layout, layout, blocks, [order])
    assert (len(plan), plan.nbytes) == (1024, 512 * MiB)  # a TP-8 rank: 512 KiB per block of 64 layers
    gather, scatter = gather_copy(plan), scatter_copy(plan)
    assert gather.row_bytes == scatter.row_bytes == 512 * 1024
    assert scatter.region_row.tolist() == sorted(order)
    # slot row i holds the source block written into the i-th lowest destination block
    destination_of = dict(zip(blocks[0], order, strict=True))
    assert [destination_of[b] for b in gather.region_row.tolist()] == sorted(order)


def test_the_cost_model_reproduces_the_h200_figures_it_was_fitted_to() -> None:
    costs = PathCosts()
    assert costs.direct_ms(65_536, 512 * MiB) == pytest.approx(534, rel=0.06)  # layer-outer, scattered
    assert costs.direct_ms(1_024, 512 * MiB) == pytest.approx(6.3, rel=0.35)  # block-outer, scattered
    assert costs.direct_ms(1, 512 * MiB) == pytest.approx(0.37, rel=0.1)  # contiguous
    for mib, measured in ((32, 0.98), (128, 1.29), (512, 2.76), (40, 1.18), (160, 1.62), (640, 3.57)):
        assert costs.staged_ms(mib * MiB) == pytest.approx(measured, rel=0.15)


def test_fragmented_requests_go_staged_and_contiguous_small_or_oversized_ones_direct() -> None:
    costs = PathCosts()
    scattered = choose_path(1_024, 512 * MiB, 512 * MiB, costs)
    assert scattered.path is TransferPath.STAGED and scattered.staged_ms < scattered.direct_ms / 2
    assert choose_path(1, 512 * MiB, 512 * MiB, costs).path is TransferPath.DIRECT
    assert choose_path(64, 32 * MiB, 512 * MiB, costs).path is TransferPath.DIRECT  # 1k tokens, as measured
    assert choose_path(256, 128 * MiB, 512 * MiB, costs).path is TransferPath.STAGED  # 4k tokens, as measured
    assert (
        choose_path(48, 49 * MiB, 512 * MiB, costs).path is TransferPath.DIRECT
    )  # a Super rank, as measured
    for slot in (0, 256 * MiB):
        unstaged = choose_path(1_024, 512 * MiB, slot, costs)
        assert unstaged.path is TransferPath.DIRECT and unstaged.staged_ms == float("inf")


def test_a_staging_buffer_costs_the_blocks_its_bytes_would_hold() -> None:
    layout, _ = qwen_rank(1_024)
    assert layout.num_slots * layout.page_bytes == 512 * 1024
    assert staging_cost_blocks(512 * MiB, layout) == 1024
    assert staging_cost_blocks(512 * MiB + 1, layout) == 1025
    assert staging_cost_blocks(0, layout) == 0
    assert LayerKind.ATTENTION in layout.model.layers


def test_bad_figures_are_refused_by_name() -> None:
    layout, _ = qwen_rank(1_024)
    with pytest.raises(ValueError, match=r"PathCosts\.link_gbps must be positive"):
        PathCosts(link_gbps=0)
    with pytest.raises(ValueError, match="staging_bytes must not be negative"):
        staging_cost_blocks(-1, layout)
