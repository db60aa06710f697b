"""What an engine tells its peers about itself over the side channel: its ranks' agents and memory, and its KV
layout.

The layout is summarised as named fields (model shape, block sizes, dtypes, conv layout) so
that two engines that cannot exchange KV are told *what* differs, and fingerprinted so a
registration can carry the check cheaply. TP size and pool size are not part of the
fingerprint: engines of different TP (within the supported pairs) and pool sizes interoperate.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import asdict
from typing import Annotated, Final

import msgspec

from pdconnector.layout import BlockPlacement, KVModel, LayerKind, RankLayout, check_compatible
from pdconnector.protocol.messages import (
    MAX_AGENT_METADATA_BYTES,
    MAX_REGIONS,
    MAX_TP_SIZE,
    DeviceId,
    DoorbellPort,
    EngineId,
    Host,
)
from pdconnector.protocol.params import INCARNATION_PATTERN

MAX_LAYOUT_FIELDS: Final = 64


class RankInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One TP rank's transfer agent: how to reach it, where its regions start and on which device they live
    (``cuda:device_id`` for VRAM, a device of the rank's own node; every remote descriptor must name it), the
    address of the node it runs on (``host``: an engine larger than a node has ranks on several), the UDP port
    of its doorbell there (0: none), and where its blocks' pages sit. A peer that predates ``host`` leaves it
    out: its ranks are all on its side-channel host."""

    tp_rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP_SIZE)]
    agent_name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_AGENT_METADATA_BYTES)]
    region_base_addresses: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=0)], ...], msgspec.Meta(max_length=MAX_REGIONS)
    ]
    num_blocks: Annotated[int, msgspec.Meta(ge=1)]
    device_id: DeviceId = 0
    doorbell_port: DoorbellPort = 0
    placement: BlockPlacement = BlockPlacement.LAYER_OUTER
    host: Host | None = None


class EngineInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An engine as its side channel describes it; ``ranks`` holds one entry per TP rank, in rank order, from
    every node the engine spans (vLLM gathers the ranks' handshakes into the engine core on the first node,
    whose side channel serves them all). ``incarnation``: this start of the engine (a restart, or a group of
    nodes recreated, keeps the engine id and gets a new one; empty from a peer that predates it)."""

    engine_id: EngineId
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)]
    layout: Annotated[dict[str, str], msgspec.Meta(max_length=MAX_LAYOUT_FIELDS)]
    ranks: Annotated[tuple[RankInfo, ...], msgspec.Meta(max_length=MAX_TP_SIZE)]
    incarnation: Annotated[str, msgspec.Meta(pattern=f"^$|{INCARNATION_PATTERN}")] = ""

    def __post_init__(self) -> None:
        if [r.tp_rank for r in self.ranks] != list(range(self.tp_size)):
            raise ValueError(
                f"engine {self.engine_id}: ranks must be 0..{self.tp_size - 1} in order, got "
                f"{[r.tp_rank for r in self.ranks]}"
            )

    @property
    def layout_fingerprint(self) -> str:
        return fingerprint(self.layout)

    def rank_layout(self, model: KVModel, tp_rank: int) -> RankLayout:
        """The layout of one of this engine's ranks, as planned by a peer running ``model``."""
        rank = self.ranks[tp_rank]
        return RankLayout(model, self.tp_size, tp_rank, rank.num_blocks, rank.placement)


def layout_summary(model: KVModel) -> dict[str, str]:
    """The model's KV layout as named fields (what must be equal on both sides of a transfer)."""
    fields = {
        "layers": "".join("A" if kind is LayerKind.ATTENTION else "S" for kind in model.layers),
        "block_size": str(model.block_size),
        "kernel_block_size": str(model.kernel_block_size),
    }
    for name, spec in (("attention", model.attention), ("ssm", model.ssm)):
        if spec is not None:
            for key, value in asdict(spec).items():
                fields[f"{name}.{key}"] = json.dumps(value, sort_keys=True, default=str)
    return fields


def fingerprint(summary: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:32]


def layout_differences(local: dict[str, str], remote: dict[str, str]) -> list[str]:
    """Human-readable differences, one per field (empty when the layouts match)."""
    keys = sorted(local.keys() | remote.keys())
    return [
        f"{key}: local {local.get(key, '<absent>')} != remote {remote.get(key, '<absent>')}"
        for key in keys
        if local.get(key) != remote.get(key)
    ]


class IncompatiblePeer(ValueError):
    """A peer engine whose KV this engine cannot exchange; the message names what differs."""


def check_peer(local_layout: RankLayout, peer: EngineInfo, *, peer_is_prefill: bool) -> None:
    """Raise :class:`IncompatiblePeer` unless KV can move between ``local_layout`` and every rank of ``peer``
    it pairs with."""
    differences = layout_differences(layout_summary(local_layout.model), peer.layout)
    if differences:
        raise IncompatiblePeer(
            f"engine {peer.engine_id} has an incompatible KV layout: " + "; ".join(differences)
        )
    try:
        remote = peer.rank_layout(local_layout.model, 0)
        if peer_is_prefill:
            check_compatible(remote, local_layout)
        else:
            check_compatible(local_layout, remote)
    except ValueError as error:
        raise IncompatiblePeer(f"engine {peer.engine_id}: {error}") from None
    for rank in peer.ranks:
        expected_regions = len(peer.rank_layout(local_layout.model, rank.tp_rank).regions)
        if len(rank.region_base_addresses) != expected_regions:
            count = len(rank.region_base_addresses)
            detail = f"{count} regions, its {rank.placement} layout has {expected_regions}"
            raise IncompatiblePeer(f"engine {peer.engine_id} rank {rank.tp_rank}: {detail}")


def agent_name(engine_id: str, tp_rank: int) -> str:
    """Unique per process incarnation: a restarted engine keeps its engine id, but bytes meant for its
    previous life must not reach it, so its agents get names no earlier incarnation had."""
    return f"{engine_id}-tp{tp_rank}-{os.getpid()}-{secrets.token_hex(3)}"
