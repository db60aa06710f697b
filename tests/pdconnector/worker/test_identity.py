"""What engines tell each other about their layout, and the compatibility check that names what differs."""

from __future__ import annotations

import msgspec
import pytest
from pdconnector.layout import BlockPlacement, RankLayout
from pdconnector.worker import (
    EngineInfo,
    IncompatiblePeer,
    RankInfo,
    check_peer,
    layout_differences,
    layout_summary,
)

from tests.pdconnector.worker.engines import MODELS


def engine(
    model: str, tp: int, *, regions: int | None = None, placement: BlockPlacement = BlockPlacement.LAYER_OUTER
) -> EngineInfo:
    layout = RankLayout(MODELS[model], tp, 0, 8, placement)
    count = len(layout.regions) if regions is None else regions
    ranks = tuple(
        RankInfo(
            tp_rank=r,
            agent_name=f"a{r}",
            agent_metadata=b"",
            region_base_addresses=(4096,) * count,
            num_blocks=8,
            placement=placement,
        )
        for r in range(tp)
    )
    return EngineInfo(engine_id="peer", tp_size=tp, layout=layout_summary(MODELS[model]), ranks=ranks)


def test_equal_models_of_supported_tp_pairs_are_compatible() -> None:
    for p_tp, d_tp in ((1, 4), (4, 1), (2, 2)):
        check_peer(RankLayout(MODELS["mamba2"], d_tp, 0, 8), engine("mamba2", p_tp), peer_is_prefill=True)


def test_differences_are_named_field_by_field() -> None:
    assert layout_differences(layout_summary(MODELS["dense_wide"]), layout_summary(MODELS["dense"])) == [
        "attention.head_dim: local 16 != remote 8"
    ]
    differences = layout_differences(layout_summary(MODELS["dense"]), layout_summary(MODELS["mamba2"]))
    assert any(d.startswith("layers: local AAA != remote SASA") for d in differences)
    assert any(d.startswith("ssm.family: local <absent>") for d in differences)


def test_incompatible_layout_is_refused_naming_the_field() -> None:
    with pytest.raises(IncompatiblePeer, match=r"attention.head_dim: local 16 != remote 8"):
        check_peer(RankLayout(MODELS["dense_wide"], 1, 0, 8), engine("dense", 1), peer_is_prefill=True)


def test_mamba1_state_needs_equal_tp() -> None:
    with pytest.raises(IncompatiblePeer, match="mamba1 state transfer needs equal TP"):
        check_peer(RankLayout(MODELS["mamba1"], 2, 0, 8), engine("mamba1", 1), peer_is_prefill=True)


def test_a_tp_size_the_model_cannot_be_sharded_by_is_refused() -> None:
    ranks = tuple(
        RankInfo(
            tp_rank=r, agent_name=f"a{r}", agent_metadata=b"", region_base_addresses=(4096,) * 3, num_blocks=8
        )
        for r in range(3)
    )
    peer = EngineInfo(engine_id="peer", tp_size=3, layout=layout_summary(MODELS["dense"]), ranks=ranks)
    with pytest.raises(IncompatiblePeer, match="not divisible by tp_size 3"):
        check_peer(RankLayout(MODELS["dense"], 1, 0, 8), peer, peer_is_prefill=True)


def test_a_peer_advertising_the_wrong_number_of_regions_is_refused() -> None:
    with pytest.raises(IncompatiblePeer, match="2 regions, its layer_outer layout has 3"):
        check_peer(RankLayout(MODELS["dense"], 1, 0, 8), engine("dense", 1, regions=2), peer_is_prefill=True)
    with pytest.raises(IncompatiblePeer, match="3 regions, its block_outer layout has 1"):
        check_peer(
            RankLayout(MODELS["dense"], 1, 0, 8),
            engine("dense", 1, regions=3, placement=BlockPlacement.BLOCK_OUTER),
            peer_is_prefill=True,
        )


def test_a_peer_placing_its_blocks_differently_is_compatible_and_planned_with_its_own_placement() -> None:
    peer = engine("dense", 2, placement=BlockPlacement.BLOCK_OUTER)
    check_peer(RankLayout(MODELS["dense"], 1, 0, 8), peer, peer_is_prefill=True)
    remote = peer.rank_layout(MODELS["dense"], 1)
    assert (remote.placement, len(remote.regions)) == (BlockPlacement.BLOCK_OUTER, 1)


def test_engine_info_requires_every_rank_in_order() -> None:
    rank = RankInfo(tp_rank=1, agent_name="a1", agent_metadata=b"", region_base_addresses=(), num_blocks=8)
    with pytest.raises(ValueError, match=r"ranks must be 0..1 in order, got \[1\]"):
        EngineInfo(engine_id="peer", tp_size=2, layout={}, ranks=(rank,))


def test_a_rank_names_its_node_and_a_peer_that_predates_the_field_reads_as_on_the_side_channel_host() -> None:
    rank = RankInfo(
        tp_rank=0,
        agent_name="a0",
        agent_metadata=b"",
        region_base_addresses=(),
        num_blocks=8,
        host="10.0.1.7",
    )
    wire = msgspec.msgpack.encode(rank)
    assert msgspec.msgpack.decode(wire, type=RankInfo).host == "10.0.1.7"
    older = {k: v for k, v in msgspec.structs.asdict(rank).items() if k != "host"}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(older), type=RankInfo).host is None
    with pytest.raises(msgspec.ValidationError, match=r"\$\.host"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({**older, "host": "10.0.1.7; rm -rf /"}), type=RankInfo)
