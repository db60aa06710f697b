"""Transfer volume vs prompt length, naive whole pages vs what the planner moves."""

from __future__ import annotations

import pytest
from pdconnector.layout import (
    AttentionSpec,
    KVModel,
    LayerKind,
    SsmSpec,
    format_volume_table,
    transfer_volume,
    transfer_volume_table,
)


def _hybrid(kernel_block: int) -> KVModel:
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
    return KVModel((LayerKind.SSM,) * 6 + (LayerKind.ATTENTION,) * 2, 1312, attention, ssm, kernel_block)


def test_attention_volume_grows_with_length_and_ssm_volume_does_not() -> None:
    rows = transfer_volume_table(_hybrid(32), (1024, 2048, 4096))
    assert [r.num_tokens for r in rows] == [1024, 2048, 4096]
    assert rows[0].ssm_optimal == rows[2].ssm_optimal == 6 * 5_316_608
    assert rows[0].ssm_naive == 6 * 5_373_952
    # naive: whole 1312-token blocks; optimal: the 32-token kernel blocks holding tokens (4,096 B per token
    # per layer)
    assert rows[0].attention_naive == 2 * 1312 * 4096 and rows[0].attention_optimal == 2 * 1024 * 4096
    assert rows[1].attention_naive == 2 * 2 * 1312 * 4096 and rows[1].attention_optimal == 2 * 2048 * 4096
    # 4096 tokens fill 3 blocks and 160 tokens of a fourth: the naive transfer ships that block whole
    assert rows[2].attention_naive == 2 * 4 * 1312 * 4096 and rows[2].attention_optimal == 2 * 4096 * 4096
    assert rows[2].saved == rows[2].naive - rows[2].optimal == 2 * (4 * 1312 - 4096) * 4096 + 6 * 57_344
    assert 0 < rows[2].saved_fraction < 1


def test_without_kernel_split_only_the_ssm_padding_is_saved() -> None:
    row = transfer_volume(_hybrid(1312), 1000)
    assert row.attention_naive == row.attention_optimal
    assert row.saved == 6 * (5_373_952 - 5_316_608)


def test_volume_is_engine_wide_whatever_the_tp() -> None:
    one, four = transfer_volume(_hybrid(32), 3000), transfer_volume(_hybrid(32), 3000, tp_size=4)
    assert (one.naive, one.optimal) == (four.naive, four.optimal)


def test_table_prints_one_line_per_length() -> None:
    text = format_volume_table(transfer_volume_table(_hybrid(32)))
    assert len(text.splitlines()) == 6 and "16384" in text


def test_non_positive_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="num_tokens must be positive"):
        transfer_volume(_hybrid(32), 0)
