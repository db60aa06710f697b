"""Transfer scenarios shared by the in-process matrix and the cross-process runs (engines are :class:`Engine`
or :class:`EngineProcess`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pdconnector.layout import BlockPlacement, LayerKind, RankLayout, plan_transfer, writers_for

from tests.pdconnector.worker.engines import MODELS, request_blocks

TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Pair:
    """A started prefill engine and decode engine of one model."""

    prefill: Any
    decode: Any
    coords: dict[str, Any]  # the prefill engine's coordinates, as the router hands them to decode
    model: str
    tps: tuple[int, int]
    blocks: tuple[int, int]  # pool sizes
    placement: BlockPlacement = BlockPlacement.LAYER_OUTER  # both engines'


@contextlib.contextmanager
def started(
    prefill: Any,
    decode: Any,
    model: str,
    tps: tuple[int, int],
    blocks: tuple[int, int],
    *,
    placement: BlockPlacement = BlockPlacement.LAYER_OUTER,
) -> Iterator[Pair]:
    """Both engines started (decode is handed prefill's coordinates), both closed on the way out."""
    try:
        coords = prefill.start()
        decode.start()
        yield Pair(prefill, decode, coords, model, tps, blocks, placement)
    finally:
        decode.close()
        prefill.close()


def push_both_orders(pair: Pair) -> None:
    """Two pushes, registration first then prefill first, with different sizes; every decode byte as expected,
    guards intact."""
    prefill, decode, coords, model, tps = pair.prefill, pair.decode, pair.coords, pair.model, pair.tps
    spec, (p_blocks, d_blocks) = MODELS[model], pair.blocks
    received = []
    for index, (num_tokens, registration_first) in enumerate(
        ((spec.block_size * 3 - 5, True), (spec.block_size + 1, False))
    ):
        transfer_id = f"tx-{model}-{index}"
        src = request_blocks(spec, p_blocks, num_tokens, seed=2 * index + 1)
        dst = request_blocks(spec, d_blocks, num_tokens, seed=2 * index + 2)
        prefill.fill(blocks=src, num_tokens=num_tokens)
        if registration_first:
            decode.expect_push(
                transfer_id=transfer_id,
                prefill=coords,
                blocks=dst,
                num_tokens=num_tokens,
                timeout_s=TIMEOUT_S,
            )
            assert prefill.wait_stat(name="registrations_received", value=index + 1, timeout_s=TIMEOUT_S)
            assert decode.wait(transfer_id=transfer_id, timeout_s=0.05) == [], (
                "completed before prefill finished"
            )
            prefill.prefill_finished(transfer_id=transfer_id, blocks=src, num_tokens=num_tokens)
        else:
            prefill.prefill_finished(transfer_id=transfer_id, blocks=src, num_tokens=num_tokens)
            assert prefill.wait_stat(name="prefills_finished", value=index + 1, timeout_s=TIMEOUT_S)
            decode.expect_push(
                transfer_id=transfer_id,
                prefill=coords,
                blocks=dst,
                num_tokens=num_tokens,
                timeout_s=TIMEOUT_S,
            )
        received.append({"dst": dst, "src": src, "num_tokens": num_tokens})
        assert_received(decode, transfer_id, tps[1])
        assert_sent(prefill, transfer_id, tps[0])
    assert decode.check(received=received) == {"wrong_bytes": 0, "guard_bytes": 0}


def push_after_a_prefix_hit(pair: Pair, cached: int = 2) -> None:
    """Decode holds the first ``cached`` attention blocks of a 5-block prompt and registers the rest: prefill
    writes only its blocks after them, one for one, moves SSM state whole, and leaves decode's cached blocks
    untouched."""
    prefill, decode, coords, model, tps = pair.prefill, pair.decode, pair.coords, pair.model, pair.tps
    spec, (p_blocks, d_blocks) = MODELS[model], pair.blocks
    num_tokens, lacking_tokens = spec.block_size * 5 - 3, spec.block_size * (5 - cached) - 3
    src = request_blocks(spec, p_blocks, num_tokens, seed=21)
    # decode's blocks for the whole prompt, cached ones first
    held = request_blocks(spec, d_blocks, num_tokens, seed=22)
    attention = [group.kind is LayerKind.ATTENTION for group in RankLayout(spec, 1, 0, d_blocks).groups]
    dst = [
        group[cached:] if is_attention else group for group, is_attention in zip(held, attention, strict=True)
    ]
    written = [
        group[cached:] if is_attention else group for group, is_attention in zip(src, attention, strict=True)
    ]
    prefill.fill(blocks=src, num_tokens=num_tokens)
    transfer_id = f"tx-hit-{model}"
    prefill.prefill_finished(transfer_id=transfer_id, blocks=src, num_tokens=num_tokens)
    decode.expect_push(
        transfer_id=transfer_id,
        prefill=coords,
        blocks=dst,
        num_tokens=lacking_tokens,
        timeout_s=TIMEOUT_S,
        cached_blocks=cached,
    )
    results = assert_received(decode, transfer_id, tps[1])
    assert_sent(prefill, transfer_id, tps[0])
    assert decode.check(received=[{"dst": dst, "src": written, "num_tokens": lacking_tokens}]) == {
        "wrong_bytes": 0,
        "guard_bytes": 0,
    }
    p_tp, d_tp = tps
    planned = sum(
        plan_transfer(
            RankLayout(spec, p_tp, p, p_blocks),
            RankLayout(spec, d_tp, d, d_blocks),
            written,
            dst,
            num_tokens=lacking_tokens,
        ).nbytes
        for d in range(d_tp)
        for p in writers_for(d, p_tp, d_tp)
    )
    assert sum(r["nbytes"] for r in results) == planned


def pull(pair: Pair) -> None:
    """A READ of prefill's blocks into decode's; prefill frees only once every reading decode rank said so."""
    prefill, decode, coords, model, tps = pair.prefill, pair.decode, pair.coords, pair.model, pair.tps
    spec, (p_blocks, d_blocks) = MODELS[model], pair.blocks
    num_tokens = spec.block_size * 2 + 3
    transfer_id = f"tx-pull-{model}"
    src = request_blocks(spec, p_blocks, num_tokens, seed=11)
    dst = request_blocks(spec, d_blocks, num_tokens, seed=12)
    prefill.fill(blocks=src, num_tokens=num_tokens)
    prefill.prefill_finished(transfer_id=transfer_id, blocks=src, num_tokens=num_tokens, pull=True)
    decode.read(
        transfer_id=transfer_id,
        prefill=coords,
        remote_blocks=src,
        blocks=dst,
        num_tokens=num_tokens,
        timeout_s=TIMEOUT_S,
    )
    assert_received(decode, transfer_id, tps[1])
    assert_sent(prefill, transfer_id, tps[0])
    assert decode.check(received=[{"dst": dst, "src": src, "num_tokens": num_tokens}]) == {
        "wrong_bytes": 0,
        "guard_bytes": 0,
    }


def push_then_pull(pair: Pair) -> None:
    """Both push orders, then a pull into a decode pool filled afresh: every mode on one pair of engines."""
    push_both_orders(pair)
    pair.decode.reset()
    pull(pair)


def assert_received(
    decode: Any, transfer_id: str, ranks: int, timeout_s: float = TIMEOUT_S
) -> list[dict[str, Any]]:
    """Every decode rank reported the transfer received, exactly once."""
    results = decode.wait(transfer_id=transfer_id, timeout_s=timeout_s)
    assert sorted((r["rank"], r["kind"]) for r in results) == [
        (rank, "finished_recving") for rank in range(ranks)
    ], results
    return results


def assert_sent(
    prefill: Any, transfer_id: str, ranks: int, outcome: str = "written", timeout_s: float = TIMEOUT_S
) -> list[dict[str, Any]]:
    """Every prefill rank released the transfer's blocks with ``outcome``, exactly once."""
    results = prefill.wait(transfer_id=transfer_id, timeout_s=timeout_s)
    assert sorted((r["rank"], r["kind"], r["outcome"]) for r in results) == [
        (rank, "finished_sending", outcome) for rank in range(ranks)
    ], results
    return results
