"""A transport with a small notification limit (LIBFABRIC's is a few KiB; the mock stands in for it):
registrations leave their inline agent metadata out to fit, prefill takes decode's agent from the side-channel
announce instead, and a registration too large even so is refused at once with the limit named, never sent to
be dropped on the wire."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.pdconnector.worker.engines import MODELS, Engine, request_blocks

NUM_BLOCKS = 1024  # block ids above 255 take 3 bytes each in a registration
LIMIT = 448  # between the size of the test's registration with its inline agent metadata and without


@pytest.fixture
def engines() -> Iterator[tuple[Engine, Engine, dict]]:
    small = {"notification_limit": LIMIT}
    prefill = Engine(
        "prefill-small-notif", "dense", tp=1, num_blocks=NUM_BLOCKS, transport="mock", transport_options=small
    )
    decode = Engine(
        "decode-small-notif", "dense", tp=1, num_blocks=NUM_BLOCKS, transport="mock", transport_options=small
    )
    coords = prefill.start()
    decode.start()
    yield prefill, decode, coords
    decode.close()
    prefill.close()


def test_a_registration_over_the_limit_drops_its_inline_metadata_and_the_transfer_still_lands(
    engines,
) -> None:
    prefill, decode, coords = engines
    spec = MODELS["dense"]
    num_tokens = spec.block_size * 6 + 3
    src, dst = (
        request_blocks(spec, NUM_BLOCKS, num_tokens, seed=1),
        request_blocks(spec, NUM_BLOCKS, num_tokens, seed=2),
    )
    prefill.fill(blocks=src, num_tokens=num_tokens)
    decode.expect_push("tx-small", prefill=coords, blocks=dst, num_tokens=num_tokens, timeout_s=10)
    prefill.prefill_finished(transfer_id="tx-small", blocks=src, num_tokens=num_tokens)
    results = decode.wait(transfer_id="tx-small", timeout_s=10)
    assert [(r["kind"], r["outcome"]) for r in results] == [("finished_recving", "received")], results
    assert decode.check(received=[{"dst": dst, "src": src, "num_tokens": num_tokens}]) == {
        "wrong_bytes": 0,
        "guard_bytes": 0,
    }
    assert decode.stats()[0]["registrations_without_metadata"] == 1


def test_a_registration_too_large_even_without_metadata_fails_at_once_naming_the_limit(engines) -> None:
    _, decode, coords = engines
    spec = MODELS["dense"]
    num_tokens = spec.block_size * 600
    dst = request_blocks(spec, NUM_BLOCKS, num_tokens, seed=3)
    decode.expect_push("tx-huge", prefill=coords, blocks=dst, num_tokens=num_tokens, timeout_s=10)
    results = decode.wait(transfer_id="tx-huge", timeout_s=5)
    assert [(r["kind"], r["outcome"]) for r in results] == [("failed_recving", "invalid_registration")], (
        results
    )
    assert f"{LIMIT}-byte notification limit" in results[0]["detail"]
