"""The staged path between two engines in this process over MockTransport: prefill gathers a request into a
slot of its staging buffer, one WRITE moves it into the slot decode offered, decode scatters it before it
reports the request received; every byte lands where the direct path puts it, the cost model and the slots
decide when it is taken, and every slot comes back whatever the transfer's end."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pdconnector.layout.staging import PathCosts, TransferPath
from pdconnector.worker.staging import StagingConfig

from tests.pdconnector.worker.engines import MODELS, Engine, request_blocks
from tests.pdconnector.worker.scenarios import (
    TIMEOUT_S,
    Pair,
    assert_received,
    assert_sent,
    push_after_a_prefix_hit,
    push_both_orders,
    started,
)

BLOCKS = (24, 40)
MiB = 2**20
STAGED = StagingConfig(nbytes=4 * MiB, slots=2, path=TransferPath.STAGED)
H200_COSTS = StagingConfig(nbytes=4 * MiB, slots=2)
# what descriptors cost where posting dominates: the cost model stages anything of more than one run
POSTING_BOUND = StagingConfig(nbytes=4 * MiB, slots=2, costs=PathCosts(descriptor_us=10_000.0))

CASES = [
    ("dense", 1, 1, "layer_outer"),
    ("dense", 2, 4, "layer_outer"),
    ("dense", 4, 2, "block_outer"),
    ("dense_two_heads", 4, 1, "layer_outer"),  # replicated heads: two writers send nothing but a notice
    ("mamba2", 2, 1, "layer_outer"),
    ("gdn", 1, 2, "block_outer"),
    ("mamba1", 2, 2, "layer_outer"),
]
IDS = [f"{m}-P{p}-D{d}-{placement}" for m, p, d, placement in CASES]


def engines(
    model: str,
    p_tp: int,
    d_tp: int,
    *,
    placement: str = "layer_outer",
    prefill_staging: StagingConfig | None = STAGED,
    decode_staging: StagingConfig | None = STAGED,
) -> tuple[Engine, Engine]:
    def engine(name: str, tp: int, blocks: int, staging: StagingConfig | None) -> Engine:
        return Engine(
            name, model, tp=tp, num_blocks=blocks, transport="mock", placement=placement, staging=staging
        )

    return engine("prefill-0", p_tp, BLOCKS[0], prefill_staging), engine(
        "decode-0", d_tp, BLOCKS[1], decode_staging
    )


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    model, p_tp, d_tp, placement = request.param
    with started(*engines(model, p_tp, d_tp, placement=placement), model, (p_tp, d_tp), BLOCKS) as both:
        yield both


def stat(engine: Engine, name: str) -> list[int]:
    return [s.get(name, 0) for s in engine.stats()]


@pytest.mark.parametrize("pair", CASES, indirect=True, ids=IDS)
def test_staged_pushes_land_every_byte_and_give_every_slot_back(pair: Pair) -> None:
    push_both_orders(pair)
    pair.decode.reset()
    push_after_a_prefix_hit(pair)
    staged, posted = stat(pair.prefill, "writes_staged"), stat(pair.prefill, "writes_posted")
    assert sum(staged) > 0
    assert all(s <= p for s, p in zip(staged, posted, strict=True))
    assert pair.prefill.wait_stat(name="staging_slots_free", value=STAGED.slots, timeout_s=TIMEOUT_S)
    assert pair.decode.wait_stat(name="staging_slots_free", value=STAGED.slots, timeout_s=TIMEOUT_S)


def push(pair: Pair, transfer_id: str, num_tokens: int, seed: int) -> dict[str, Any]:
    spec, (p_blocks, d_blocks) = MODELS[pair.model], pair.blocks
    src = request_blocks(spec, p_blocks, num_tokens, seed=seed)
    dst = request_blocks(spec, d_blocks, num_tokens, seed=seed + 1)
    pair.prefill.fill(blocks=src, num_tokens=num_tokens)
    pair.decode.expect_push(
        transfer_id=transfer_id, prefill=pair.coords, blocks=dst, num_tokens=num_tokens, timeout_s=TIMEOUT_S
    )
    pair.prefill.prefill_finished(transfer_id=transfer_id, blocks=src, num_tokens=num_tokens)
    return {"dst": dst, "src": src, "num_tokens": num_tokens}


@pytest.mark.parametrize(
    ("prefill_staging", "decode_staging", "staged"),
    [
        (H200_COSTS, H200_COSTS, False),  # a small request goes direct
        (POSTING_BOUND, POSTING_BOUND, True),
        (None, STAGED, False),  # decode offers, prefill has no buffer
        (STAGED, None, False),  # prefill could stage, decode offers nothing
        (StagingConfig(nbytes=4 * MiB, path=TransferPath.DIRECT), STAGED, False),
    ],
    ids=["h200-costs", "posting-bound", "prefill-without-buffer", "decode-without-buffer", "forced-direct"],
)
def test_the_cost_model_and_both_sides_buffers_decide_the_path_and_bytes_land_either_way(
    prefill_staging: StagingConfig | None, decode_staging: StagingConfig | None, staged: bool
) -> None:
    prefill, decode = engines(
        "dense",
        2,
        2,
        prefill_staging=prefill_staging,
        decode_staging=decode_staging,
    )
    with started(prefill, decode, "dense", (2, 2), BLOCKS) as pair:
        received = [
            push(pair, f"tx-path-{i}", MODELS["dense"].block_size * 3 - 1, seed=10 * i) for i in range(2)
        ]
        for i in range(2):
            assert_received(decode, f"tx-path-{i}", 2)
            assert_sent(prefill, f"tx-path-{i}", 2)
        assert decode.check(received=received) == {"wrong_bytes": 0, "guard_bytes": 0}
        assert (sum(stat(prefill, "writes_staged")) == 4) is staged
        assert sum(stat(prefill, "writes_staged")) in (0, 4)
        if decode_staging is not None:
            assert decode.wait_stat(
                name="staging_slots_free", value=decode_staging.slots, timeout_s=TIMEOUT_S
            )


def test_a_request_larger_than_a_slot_goes_direct_and_a_busy_buffer_sends_the_next_one_direct() -> None:
    small = StagingConfig(nbytes=2 * 4096, slots=1, path=TransferPath.STAGED)  # one slot of 8 KiB
    prefill, decode = engines("dense", 1, 1, prefill_staging=STAGED, decode_staging=small)
    with started(prefill, decode, "dense", (1, 1), BLOCKS) as pair:
        tokens = MODELS["dense"].block_size
        received = [push(pair, "tx-large", tokens * 4, seed=1)]
        assert_received(decode, "tx-large", 1)
        assert stat(prefill, "staging_too_large") == [1]
        # One decode slot: the first of two registered transfers holds it, the second is offered nothing.
        spec = MODELS["dense"]
        for i in range(2):
            dst = request_blocks(spec, BLOCKS[1], 1, seed=3 + 2 * i)
            decode.expect_push(
                transfer_id=f"tx-small-{i}",
                prefill=pair.coords,
                blocks=dst,
                num_tokens=1,
                timeout_s=TIMEOUT_S,
            )
            received.append(
                {"dst": dst, "src": request_blocks(spec, BLOCKS[0], 1, seed=4 + 2 * i), "num_tokens": 1}
            )
        assert prefill.wait_stat(name="registrations_received", value=3, timeout_s=TIMEOUT_S)
        for i, transfer in enumerate(received[1:]):
            prefill.fill(blocks=transfer["src"], num_tokens=1)
            prefill.prefill_finished(transfer_id=f"tx-small-{i}", blocks=transfer["src"], num_tokens=1)
            assert_received(decode, f"tx-small-{i}", 1)
        assert stat(prefill, "writes_staged") == [1]
        assert decode.check(received=received) == {"wrong_bytes": 0, "guard_bytes": 0}
        assert decode.wait_stat(name="staging_slots_free", value=1, timeout_s=TIMEOUT_S)


def test_a_transfer_that_fails_gives_its_slots_back_once_its_writers_are_quiet() -> None:
    prefill, decode = engines("dense", 2, 1)
    with started(prefill, decode, "dense", (2, 1), BLOCKS) as pair:
        spec = MODELS["dense"]
        dst = request_blocks(spec, BLOCKS[1], spec.block_size, seed=5)
        decode.expect_push(
            transfer_id="tx-cancel",
            prefill=pair.coords,
            blocks=dst,
            num_tokens=spec.block_size,
            timeout_s=TIMEOUT_S,
        )
        assert prefill.wait_stat(name="registrations_received", value=1, timeout_s=TIMEOUT_S)
        assert stat(decode, "staging_slots_free") == [STAGED.slots - 1]  # held while prefill may write
        decode.cancel("tx-cancel")
        results = decode.wait(transfer_id="tx-cancel", timeout_s=TIMEOUT_S)
        assert [r["kind"] for r in results] == ["failed_recving"]
        assert stat(decode, "staging_slots_free") == [STAGED.slots]
        # prefill, told before it posted anything, never took a slot and stages the next transfer normally
        received = [push(pair, "tx-after", spec.block_size * 2, seed=7)]
        assert_received(decode, "tx-after", 1)
        assert decode.check(received=received) == {"wrong_bytes": 0, "guard_bytes": 0}
        assert prefill.wait_stat(name="staging_slots_free", value=STAGED.slots, timeout_s=TIMEOUT_S)
