"""The layout model agrees with vLLM 0.32's own calculators: state shapes and page sizes, upstream's
conv sub-projection offsets for heterogeneous TP, HMA grouping and the attention page byte order.

vLLM is the optional ``engine`` extra; without it this module is skipped.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
from pdconnector.layout import (
    AttentionSpec,
    KVModel,
    LayerKind,
    RankLayout,
    SsmSpec,
    group_layers,
    shard_pieces,
)

pytest.importorskip("vllm", reason="vLLM is the optional 'engine' extra")

TPS = (1, 2, 4)


@pytest.fixture(scope="module")
def vllm() -> Iterator[SimpleNamespace]:
    """vLLM's calculators, with the DS conv layout selected the way an engine selects it (env var)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
        mamba_utils = importlib.import_module("vllm.model_executor.layers.mamba.mamba_utils")
        mamba_utils.get_conv_state_layout.cache_clear()
        try:
            yield SimpleNamespace(
                torch=importlib.import_module("torch"),
                shapes=mamba_utils.MambaStateShapeCalculator,
                iface=importlib.import_module("vllm.v1.kv_cache_interface"),
                conv=importlib.import_module(
                    "vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils"
                ),
                kinds=importlib.import_module(
                    "vllm.v1.attention.backends.registry"
                ).MambaAttentionBackendEnum,
                groups=importlib.import_module(
                    "vllm.v1.core.kv_cache_utils"
                )._get_kv_cache_groups_uniform_page_size,
                layouts=importlib.import_module("vllm.v1.kv_cache_layout").KVCacheLayout,
            )
        finally:
            mamba_utils.get_conv_state_layout.cache_clear()


MAMBA2 = SsmSpec.mamba2(
    num_heads=128,
    head_dim=80,
    n_groups=8,
    state_size=128,
    conv_kernel=4,
    conv_dtype_bytes=2,
    state_dtype_bytes=4,
)
GDN = SsmSpec.gdn(
    num_k_heads=16,
    num_v_heads=32,
    head_k_dim=128,
    head_v_dim=128,
    conv_kernel=4,
    conv_dtype_bytes=2,
    state_dtype_bytes=4,
)
MAMBA1 = SsmSpec.mamba1(
    intermediate_size=8192, state_size=16, conv_kernel=4, conv_dtype_bytes=2, state_dtype_bytes=4
)


def vllm_mamba_spec(v: SimpleNamespace, ssm: SsmSpec, tp: int):
    if ssm is MAMBA2:
        shapes, kind = v.shapes.mamba2_state_shape(tp, 128 * 80, 8, 128, 80, 128, 4), v.kinds.MAMBA2
    elif ssm is GDN:
        shapes, kind = v.shapes.gated_delta_net_state_shape(tp, 16, 32, 128, 128, 4), v.kinds.GDN_ATTN
    else:
        shapes, kind = v.shapes.mamba1_state_shape(tp, 8192, 16, 4), v.kinds.MAMBA1
    return v.iface.MambaSpec(
        block_size=1024, shapes=shapes, dtypes=(v.torch.bfloat16, v.torch.float32), mamba_type=kind
    )


def _rank(ssm: SsmSpec, tp: int, rank: int = 0) -> RankLayout:
    return RankLayout(KVModel((LayerKind.SSM,), 1024, None, ssm), tp, rank, 4)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("ssm", [MAMBA2, GDN, MAMBA1], ids=["mamba2", "gdn", "mamba1"])
def test_ssm_page_and_conv_sub_projections_match_vllm(vllm, ssm: SsmSpec, tp: int) -> None:
    spec = vllm_mamba_spec(vllm, ssm, tp)
    split = vllm.conv.derive_mamba_conv_split(spec, tp)
    rank = _rank(ssm, tp)
    assert rank.ssm_state_bytes == spec.page_size_bytes
    assert (rank.ssm_conv_bytes, rank.ssm_state_bytes - rank.ssm_conv_bytes) == split.ssm_sizes
    conv = list(zip(rank.ssm_schema.offsets[:-1].tolist(), rank.ssm_schema.sizes[:-1].tolist(), strict=True))
    assert conv == split.local_conv_offsets


@pytest.mark.parametrize(("p_tp", "d_tp"), [(p, d) for p, d in itertools.product(TPS, TPS)])
@pytest.mark.parametrize("ssm", [MAMBA2, GDN], ids=["mamba2", "gdn"])
def test_heterogeneous_conv_offsets_match_upstream_formulas(vllm, ssm: SsmSpec, p_tp: int, d_tp: int) -> None:
    split = vllm.conv.derive_mamba_conv_split(vllm_mamba_spec(vllm, ssm, d_tp), d_tp)
    for d in range(d_tp):
        dst = _rank(ssm, d_tp, d)
        if d_tp >= p_tp:
            ratio = d_tp // p_tp
            src = _rank(ssm, p_tp, d // ratio)
            src_off, dst_off, length = (
                a[:-1].tolist() for a in shard_pieces(src.ssm_schema, src.tp_rank, dst.ssm_schema, d)
            )
            # upstream: decode rank reads its slice of each sub-projection of one prefill page
            assert list(zip(src_off, length, strict=True)) == split.remote_conv_offsets(d % ratio, ratio)
            assert list(zip(dst_off, length, strict=True)) == split.local_conv_offsets
        else:
            ratio = p_tp // d_tp
            for p in range(d * ratio, (d + 1) * ratio):
                src = _rank(ssm, p_tp, p)
                src_off, dst_off, length = (
                    a[:-1].tolist() for a in shard_pieces(src.ssm_schema, p, dst.ssm_schema, d)
                )
                # upstream: a whole (smaller) prefill page per rank, into chunk p % ratio of each decode
                # sub-projection
                assert list(zip(src_off, length, strict=True)) == split.remote_conv_offsets(0, -ratio)
                chunks = [
                    (off + (p % ratio) * size // ratio, size // ratio)
                    for off, size in split.local_conv_offsets
                ]
                assert list(zip(dst_off, length, strict=True)) == chunks


@pytest.mark.parametrize("tp", TPS)
def test_attention_page_bytes_and_head_major_order_match_vllm(vllm, tp: int) -> None:
    attention = AttentionSpec(num_kv_heads=8, head_dim=128, dtype_bytes=2)
    model = KVModel((LayerKind.ATTENTION,), 64, attention, None, kernel_block_size=16)
    rank = RankLayout(model, tp, 0, 10)
    spec = vllm.iface.FullAttentionSpec(
        block_size=64, num_kv_heads=8 // tp, head_size=128, dtype=vllm.torch.bfloat16
    )
    assert rank.attention_page_bytes == spec.page_size_bytes
    # LBHNC (vLLM 0.32's default and the CPU backend's only layout) split into 16-token kernel blocks
    strides = vllm.iface.compute_layout_strides(spec, 10, 1, vllm.layouts.LBHNC, kernel_block_size=16)
    _, block, head, token, content = strides
    assert block == rank.physical_page_bytes
    # PACKED_HND: head h of a kernel block is the contiguous run [h * 16 * C, (h + 1) * 16 * C)
    assert (head, token, content) == (16 * 2 * 128 * 2, 2 * 128 * 2, 1)
    assert rank.attention_schema.sizes.tolist() == [8 // tp * head]


def test_hma_grouping_matches_vllm(vllm) -> None:
    pattern = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-".replace("-", "")
    mamba = vllm_mamba_spec(vllm, MAMBA2, 1)
    full = vllm.iface.FullAttentionSpec(
        block_size=1024, num_kv_heads=8, head_size=128, dtype=vllm.torch.bfloat16
    )
    specs = {f"layers.{i}": mamba if kind == "M" else full for i, kind in enumerate(pattern)}
    theirs = [[int(name.split(".")[1]) for name in g.layer_names] for g in vllm.groups(specs)]
    ours = [
        list(g.layers)
        for g in group_layers(tuple(LayerKind.SSM if k == "M" else LayerKind.ATTENTION for k in pattern))
    ]
    assert ours == theirs
    assert np.array_equal(np.sort(np.concatenate([np.asarray(g) for g in ours])), np.arange(len(pattern)))
