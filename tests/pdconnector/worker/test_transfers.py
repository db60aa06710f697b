"""Byte-exact transfers between two engines in this process over MockTransport (real TCP, real copies): the
whole prefill TP x decode TP x layout matrix, push in both arrival orders and pull, engines that place their
blocks differently (layer-, block- and head-outer caches), and push into a decode that already holds a prefix
of the prompt."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from tests.pdconnector.worker.engines import Engine
from tests.pdconnector.worker.scenarios import (
    Pair,
    pull,
    push_after_a_prefix_hit,
    push_both_orders,
    push_then_pull,
    started,
)

TPS = (1, 2, 4)
MATRIX = [
    *((model, p, d) for model in ("dense", "mamba2", "gdn") for p, d in itertools.product(TPS, TPS)),
    *(("mamba1", tp, tp) for tp in TPS),
    *(("dense_two_heads", p, d) for p, d in ((4, 4), (4, 1), (1, 4), (4, 2), (2, 4))),
]
IDS = [f"{m}-P{p}-D{d}" for m, p, d in MATRIX]
BLOCKS = (24, 40)  # prefill and decode pools differ in size


# (model, prefill TP, decode TP, prefill placement, decode placement): every placement on each side, with and
# without TP changing between them (head-outer holds attention only; the hybrid's block-outer pages interleave
# SSM and attention).
PLACED = [
    ("dense", 1, 2, "block_outer", "head_outer"),
    ("dense", 4, 2, "head_outer", "layer_outer"),
    ("dense", 2, 2, "layer_outer", "block_outer"),
    ("gdn", 2, 1, "block_outer", "block_outer"),
    ("gdn", 1, 2, "layer_outer", "block_outer"),
]
PLACED_IDS = [f"{m}-P{p}-{pp}-D{d}-{dp}" for m, p, d, pp, dp in PLACED]


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    model, p_tp, d_tp, *placements = request.param
    p_placement, d_placement = placements or ("layer_outer", "layer_outer")
    prefill = Engine(
        "prefill-0", model, tp=p_tp, num_blocks=BLOCKS[0], transport="mock", placement=p_placement
    )
    decode = Engine("decode-0", model, tp=d_tp, num_blocks=BLOCKS[1], transport="mock", placement=d_placement)
    with started(prefill, decode, model, (p_tp, d_tp), BLOCKS) as both:
        yield both


@pytest.mark.parametrize("pair", MATRIX, indirect=True, ids=IDS)
def test_push_moves_every_byte_in_either_arrival_order(pair: Pair) -> None:
    push_both_orders(pair)


@pytest.mark.parametrize("pair", PLACED, indirect=True, ids=PLACED_IDS)
def test_engines_placing_blocks_differently_exchange_every_byte_by_push_and_pull(pair: Pair) -> None:
    push_then_pull(pair)


@pytest.mark.parametrize("pair", MATRIX, indirect=True, ids=IDS)
def test_pull_reads_every_byte_and_prefill_frees_after_every_reader(pair: Pair) -> None:
    pull(pair)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 4), (4, 2)])
def test_ranks_on_devices_other_than_zero_name_their_device_in_every_descriptor(p_tp: int, d_tp: int) -> None:
    """Like a GPU engine's ``cuda:r`` per rank: prefill ranks on devices 3.., decode ranks on 5..; the
    transport refuses any descriptor that names a device other than the one its memory is registered on, so
    both sides must carry it."""
    prefill = Engine(
        "prefill-0", "mamba2", tp=p_tp, num_blocks=BLOCKS[0], transport="mock", first_device_id=3
    )
    decode = Engine("decode-0", "mamba2", tp=d_tp, num_blocks=BLOCKS[1], transport="mock", first_device_id=5)
    try:
        coords = prefill.start()
        decode.start()
        pair = Pair(prefill, decode, coords, "mamba2", (p_tp, d_tp), BLOCKS)
        push_then_pull(pair)
    finally:
        decode.close()
        prefill.close()


PREFIX_HIT = [("dense", 1, 1), ("dense", 2, 4), ("mamba2", 4, 2), ("gdn", 1, 2)]


@pytest.mark.parametrize("pair", PREFIX_HIT, indirect=True, ids=[f"{m}-P{p}-D{d}" for m, p, d in PREFIX_HIT])
def test_push_into_a_decode_holding_a_cached_prefix_writes_only_the_blocks_after_it(pair: Pair) -> None:
    push_after_a_prefix_hit(pair)
