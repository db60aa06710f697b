"""The staged path: a plan as gathered rows in bounded chunks, and the cost model that picks it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pdconnector.layout import (
    BlockPlacement,
    LayerKind,
    RankLayout,
    TransferPlan,
    model_from_hf_config,
    plan_transfer,
)
from pdconnector.layout.known_models import QWEN3_32B
from pdconnector.layout.staging import (
    PathCosts,
    TransferPath,
    choose_path,
    stage,
    staging_cost_blocks,
)
from pdconnector.layout.synthetic import allocate_pools, apply_plan

from tests.pdconnector.layout.test_plan import Case, cases

MiB = 2**20
Pools = tuple[list[np.ndarray], list[np.ndarray]]


def region_starts(layout: RankLayout) -> list[int]:
    """Each region's start when the regions are consecutive slices of one buffer, as vLLM allocates them."""
    return np.cumsum([0, *layout.region_nbytes]).tolist()[:-1]


def as_rows(buffer: np.ndarray, row_bytes: int) -> np.ndarray:
    return buffer[: buffer.size // row_bytes * row_bytes].reshape(-1, row_bytes)


def staged_copy(plan: TransferPlan, p: RankLayout, d: RankLayout, pools: Pools, chunk: int) -> None:
    """Gather each chunk's rows into a staging buffer of ``chunk`` bytes, move it, scatter it: what the
    staged path does, with numpy as the device. ``pools``: the source's and the destination's regions."""
    src, dst = pools
    src_buffer, dst_buffer = np.concatenate(src), np.concatenate(dst)
    staged = stage(plan, region_starts(p), 0, region_starts(d), 0, chunk_bytes=chunk)
    src_rows, dst_rows = as_rows(src_buffer, staged.row_bytes), as_rows(dst_buffer, staged.row_bytes)
    for k in range(staged.num_chunks):
        gather, scatter = staged.chunk(k)
        staging = src_rows[gather]  # one indexed copy per side and chunk
        assert staging.nbytes <= chunk
        dst_rows[scatter] = staging
    for region, start in enumerate(region_starts(d)):
        dst[region][:] = dst_buffer[start : start + dst[region].size]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(1, 6))
def test_staged_chunks_land_every_byte_where_the_direct_plan_puts_it(case: Case, rows_per_chunk: int) -> None:
    prefill_pools = case.tagged_prefill_pools()
    for d in case.decode:
        direct, staged = allocate_pools(d, fill=0xC3), allocate_pools(d, fill=0xC3)
        for p in case.prefill:
            plan = case.plan(p, d)
            apply_plan(plan, prefill_pools[p.tp_rank], direct)
            if len(plan):
                row = stage(plan, region_starts(p), 0, region_starts(d), 0, chunk_bytes=plan.nbytes).row_bytes
                staged_copy(plan, p, d, (prefill_pools[p.tp_rank], staged), rows_per_chunk * row)
        for got, want in zip(staged, direct, strict=True):
            np.testing.assert_array_equal(got, want)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(1, 8))
def test_rows_cover_the_plan_once_in_chunks_no_larger_than_the_bound(case: Case, rows_per_chunk: int) -> None:
    for p, d in itertools.product(case.prefill, case.decode):
        plan = case.plan(p, d)
        if not len(plan):
            continue
        src_addrs, dst_addrs = region_starts(p), region_starts(d)
        row = stage(plan, src_addrs, 0, dst_addrs, 0, chunk_bytes=plan.nbytes).row_bytes
        staged = stage(plan, src_addrs, 0, dst_addrs, 0, chunk_bytes=rows_per_chunk * row + row - 1)
        assert staged.rows_per_chunk == rows_per_chunk
        assert staged.nbytes == plan.nbytes
        assert staged.num_chunks == -(-staged.src_rows.size // rows_per_chunk)
        chunks = [staged.chunk(k) for k in range(staged.num_chunks)]
        assert all(0 < s.size == d_.size <= rows_per_chunk for s, d_ in chunks)
        np.testing.assert_array_equal(np.concatenate([s for s, _ in chunks]), staged.src_rows)
        # No destination row is written twice: a row is the unit every run is cut into.
        assert np.unique(staged.dst_rows).size == staged.dst_rows.size


def qwen_rank(tokens: int) -> tuple[RankLayout, list[list[int]]]:
    model = model_from_hf_config(QWEN3_32B, block_size=16)
    layout = RankLayout(model, 8, 0, 4 * tokens // 16, BlockPlacement.BLOCK_OUTER)
    return layout, [np.random.default_rng(7).permutation(layout.num_blocks)[: tokens // 16].tolist()]


def test_a_scattered_block_outer_request_becomes_one_row_per_block_in_few_chunks() -> None:
    layout, blocks = qwen_rank(16_384)
    plan = plan_transfer(layout, layout, blocks, blocks)
    staged = stage(plan, [0], 0, [0], 0, chunk_bytes=256 * MiB)
    assert (len(plan), plan.nbytes) == (1024, 512 * MiB)  # a TP-8 rank: 512 KiB per block of 64 layers
    assert staged.row_bytes == 512 * 1024
    assert (staged.num_chunks, staged.chunk_bytes) == (2, 256 * MiB)
    assert staged.src_rows.tolist() == blocks[0]


def test_the_cost_model_reproduces_the_h200_figures_it_was_fitted_to() -> None:
    costs = PathCosts()
    assert costs.direct_ms(65_536, 512 * MiB) == pytest.approx(505.5, rel=0.02)  # layer-outer, scattered
    assert costs.direct_ms(1_024, 512 * MiB) == pytest.approx(8.28, rel=0.02)  # block-outer, scattered
    assert costs.direct_ms(1, 512 * MiB) == pytest.approx(0.407, rel=0.02)  # contiguous
    assert costs.staged_ms(512 * MiB, 1) == pytest.approx(2.51, rel=0.1)
    assert costs.staged_ms(512 * MiB, 2) == pytest.approx(2.81, rel=0.1)
    assert costs.staged_ms(512 * MiB, 8) == pytest.approx(7.16, rel=0.02)


def test_fragmented_requests_go_staged_and_contiguous_or_small_ones_direct() -> None:
    costs = PathCosts()
    scattered = choose_path(1_024, 512 * MiB, 256 * MiB, costs)
    assert scattered.path is TransferPath.STAGED and scattered.staged_ms < scattered.direct_ms / 2
    assert choose_path(1, 512 * MiB, 256 * MiB, costs).path is TransferPath.DIRECT
    assert choose_path(64, 32 * MiB, 256 * MiB, costs).path is TransferPath.DIRECT  # 1k tokens
    unstaged = choose_path(1_024, 512 * MiB, 0, costs)
    assert unstaged.path is TransferPath.DIRECT and unstaged.staged_ms == float("inf")


def test_a_staging_buffer_costs_the_blocks_its_bytes_would_hold() -> None:
    layout, _ = qwen_rank(1_024)
    assert layout.num_slots * layout.page_bytes == 512 * 1024
    assert staging_cost_blocks(512 * MiB, layout) == 1024
    assert staging_cost_blocks(512 * MiB + 1, layout) == 1025
    assert staging_cost_blocks(0, layout) == 0
    assert LayerKind.ATTENTION in layout.model.layers


def test_bad_bounds_and_figures_are_refused_by_name() -> None:
    layout, blocks = qwen_rank(1_024)
    plan = plan_transfer(layout, layout, blocks, blocks)
    with pytest.raises(
        ValueError, match=r"chunk_bytes 4096 is smaller than one row of this plan \(524288 B\)"
    ):
        stage(plan, [0], 0, [0], 0, chunk_bytes=4096)
    with pytest.raises(ValueError, match="before its side's base address"):
        stage(plan, [0], 1, [0], 0, chunk_bytes=256 * MiB)
    with pytest.raises(ValueError, match=r"PathCosts\.link_gbps must be positive"):
        PathCosts(link_gbps=0)
    with pytest.raises(ValueError, match="staging_bytes must not be negative"):
        staging_cost_blocks(-1, layout)
