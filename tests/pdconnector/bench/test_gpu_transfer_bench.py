"""The GPU transfer benchmark end to end on host memory (``--device cpu``): two processes, real NIXL, the
planner's descriptors for real model layouts, the staged path; the figures themselves only mean something on a
GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pdconnector.bench import gpu_transfer_bench
from pdconnector.layout import RankLayout, plan_transfer
from pdconnector.layout.staging import PathCosts
from pdconnector.transport import nixl_unavailable_reason

pytestmark = pytest.mark.skipif(
    nixl_unavailable_reason() is not None, reason=f"needs NIXL: {nixl_unavailable_reason()}"
)


def test_the_bench_reports_every_case_with_descriptors_of_each_cache_layout(tmp_path: Path) -> None:
    gpu_transfer_bench.main(
        [
            str(tmp_path),
            "--device",
            "cpu",
            "--models",
            "qwen3-32b-tp8",
            "--tokens",
            "64",
            "--repeat",
            "1",
        ]
    )
    cases = json.loads((tmp_path / "gpu-transfer-bench.json").read_text())["cases"]
    by_key = {(c["placement"], c["blocks"], c["operation"]): c for c in cases}
    assert len(cases) == len(by_key) == 2 * 2 * 2  # placements x block orders x write/read
    # 64 tokens = 4 blocks of 16, 64 layers: one descriptor per layer per block, or one per block when
    # scattered
    assert by_key["layer_outer", "scattered", "write"]["descriptors"] == 4 * 64
    assert by_key["block_outer", "scattered", "write"]["descriptors"] == 4
    assert by_key["block_outer", "contiguous", "read"]["descriptors"] == 1
    # tokens x layers x K,V x head_dim x bf16 (1 head)
    assert {c["nbytes"] for c in cases} == {64 * 64 * 2 * 128 * 2}
    for case in cases:
        assert case["post_to_done_ms"] > 0 and case["copy_ms"] > 0 and case["vs_copy"] > 0
        assert (case["post_to_notified_ms"] is not None) == (case["operation"] == "write")
        assert case["verified"] is (True if case["operation"] == "write" else None)
        assert (case["staged"] is not None) == (
            case["blocks"] == "scattered" and case["operation"] == "write"
        )
    for placement, row_bytes in (("block_outer", 64 * 2 * 128 * 2 * 16), ("layer_outer", 2 * 128 * 2 * 16)):
        staged = by_key[placement, "scattered", "write"]["staged"]
        assert staged["post_to_scattered_ms"] > 0
        # gathered, written and scattered as the connector does: every byte where the direct WRITE put it
        assert staged["verified"] is True
        assert staged["row_bytes"] == row_bytes  # a block of every layer, or one layer's K and V of a block
        # the cost model next to the measurement; the EFA model is the direct path's cost on EFA figures
        assert staged["model_ms"] == round(PathCosts().staged_ms(2 * 2**20), 3)
    efa = PathCosts(descriptor_us=2.44, link_gbps=50.0)
    for case in cases:
        assert case["efa_model_ms"] == round(efa.direct_ms(case["descriptors"], case["nbytes"]), 3)


def test_the_checksum_tells_bytes_in_the_wrong_place_from_bytes_in_the_right_one() -> None:
    import torch  # noqa: PLC0415 (the bench's own dependency)

    data = torch.arange(64, dtype=torch.uint8)
    assert gpu_transfer_bench.checksum(torch, data) == gpu_transfer_bench.checksum(torch, data.clone())
    swapped = data.clone()
    swapped[[3, 9]] = swapped[[9, 3]]
    assert gpu_transfer_bench.checksum(torch, data) != gpu_transfer_bench.checksum(torch, swapped)


def test_nemotron_3_super_at_tp4_moves_one_replicated_kv_head_per_rank_in_4224_token_blocks() -> None:
    """The deployment the hybrid seed quotes: its per-rank layout, and the engine-wide volume report the bench
    writes next to its measurements (one rank's planned bytes are the report's optimal share)."""
    model = gpu_transfer_bench.MODELS["nemotron-3-super-120b-tp4"]
    kv_model = model.kv_model()
    assert kv_model.block_size == 4224
    rank = RankLayout(kv_model, model.tp_size, 0, gpu_transfer_bench.pool_blocks(kv_model, 4, 16384))
    assert rank.kv_heads_per_rank == 1
    report = gpu_transfer_bench.volume_report(["nemotron-3-super-120b-tp4", "qwen3-32b-tp8"], [1024, 16384])
    assert list(report) == ["nemotron-3-super-120b-tp4"]  # dense models have no SSM padding to report
    short, long = report["nemotron-3-super-120b-tp4"]
    assert short["naive"] > short["optimal"] and long["naive"] > long["optimal"]
    blocks = gpu_transfer_bench.request_blocks(rank, 16384, scattered=True, seed=3)
    plan = plan_transfer(rank, rank, blocks, blocks, num_tokens=16384)
    assert model.tp_size * plan.nbytes == long["optimal"]
