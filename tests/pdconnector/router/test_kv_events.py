"""Following one engine's KV cache events: batches as vLLM encodes them change the engine's index; lost,
restarted or malformed streams clear it; a flood stays bounded; a late subscriber replays what it missed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import zmq
from pdconnector.router import kv_events
from pdconnector.router.config import kv_events_replay_endpoint
from pdconnector.router.kv_events import (
    EventFeed,
    FeedOutcome,
    Subscription,
    Subscriptions,
    follow,
    parse_message,
)
from pdconnector.router.prefix import PrefixIndex, external_hash

from tests import ports
from tests.pdconnector.router.kv_event_batches import (
    ENCODER,
    batch,
    h,
    publisher_socket,
    removed,
    stored,
    until,
    vllm_events,
)


def held(feed: EventFeed, *numbers: int) -> int:
    return feed.index.matched_blocks([external_hash(h(n)) for n in numbers])


def test_stored_and_removed_blocks_change_the_index():
    feed = EventFeed(PrefixIndex(100))
    assert feed.apply(0, batch(stored(h(1), h(2)), stored(h(3)))) is FeedOutcome.APPLIED
    assert held(feed, 1, 2, 3) == 3
    assert feed.apply(1, batch(removed(h(2)))) is FeedOutcome.APPLIED
    assert held(feed, 1, 2, 3) == 1
    feed.apply(2, batch(vllm_events.AllBlocksCleared()))
    assert len(feed.index) == 0


def test_blocks_of_an_offload_tier_are_not_the_engines_cache():
    feed = EventFeed(PrefixIndex(100))
    feed.apply(0, batch(stored(h(1), medium="CPU"), stored(h(2), medium=None)))
    assert held(feed, 1) == 0 and held(feed, 2) == 1


def test_the_engines_kv_tier_has_its_own_index_which_a_prefix_cache_reset_leaves_alone():
    feed = EventFeed(PrefixIndex(100), tier_index=PrefixIndex(100))
    assert feed.tier_index is not None
    feed.apply(0, batch(stored(h(1), h(2), medium="CPU"), stored(h(3), medium="STORAGE")))
    in_tier = [external_hash(h(n)) for n in (1, 2, 3)]
    assert feed.tier_index.matched_blocks(in_tier) == 2 and held(feed, 1) == 0
    feed.apply(1, batch(removed(h(2), medium="CPU"), vllm_events.AllBlocksCleared()))
    assert feed.tier_index.matched_blocks(in_tier) == 1
    feed.apply(3, batch(stored(h(4))))  # a lost batch: the tier may be behind too
    assert len(feed.tier_index) == 0


def test_an_engine_that_published_a_tier_block_is_known_to_have_a_tier_after_its_indexes_are_cleared():
    feed = EventFeed(PrefixIndex(100), tier_index=PrefixIndex(100))
    feed.apply(0, batch(stored(h(1))))
    assert not feed.has_tier
    feed.apply(1, batch(stored(h(2), medium="CPU")))
    feed.apply(3, batch(stored(h(3))))  # a lost batch clears what it held, not that it has a tier
    assert feed.tier_index is not None and len(feed.tier_index) == 0 and feed.has_tier


def test_integer_hashes_published_under_vllms_int_option_match_the_same_blocks():
    feed = EventFeed(PrefixIndex(100))
    as_int = int.from_bytes(h(7), "big") & ((1 << 64) - 1)
    feed.apply(0, batch(vllm_events.BlockStored([as_int], None, [1] * 16, 16, None, "GPU", None)))
    assert held(feed, 7) == 1


def test_a_lost_batch_clears_the_index_before_the_next_applies():
    feed = EventFeed(PrefixIndex(100))
    feed.apply(0, batch(stored(h(1))))
    assert feed.apply(5, batch(stored(h(2)))) is FeedOutcome.GAP
    assert held(feed, 1) == 0 and held(feed, 2) == 1 and feed.gaps == 1


def test_a_sequence_that_goes_back_is_a_restarted_engine_with_an_empty_cache():
    feed = EventFeed(PrefixIndex(100))
    feed.apply(0, batch(stored(h(1))))
    feed.apply(1, batch(stored(h(2))))
    assert feed.apply(0, batch(stored(h(3)))) is FeedOutcome.RESTART
    assert held(feed, 1) == 0 and held(feed, 2) == 0 and held(feed, 3) == 1 and feed.restarts == 1


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        ENCODER.encode({"not": "a batch"}),
        ENCODER.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
    ],
)
def test_a_malformed_batch_is_ignored_and_clears_what_may_now_be_behind(payload):
    feed = EventFeed(PrefixIndex(100))
    feed.apply(0, batch(stored(h(1))))
    assert feed.apply(1, payload) is FeedOutcome.MALFORMED
    assert len(feed.index) == 0


def test_a_message_without_vllms_three_frames_is_refused_and_clears_both_indexes():
    assert parse_message([b"", (3).to_bytes(8, "big"), b"x"]) == (3, b"x")
    with pytest.raises(ValueError, match=r"3|frames"):
        parse_message([b"", b"x"])
    feed = EventFeed(PrefixIndex(100), tier_index=PrefixIndex(100))
    feed.apply(0, batch(stored(h(1)), stored(h(2), medium="CPU")))
    kv_events._take(Subscription("ipc:///unused", "kv-events", feed), [b"", b"x"])
    assert feed.tier_index is not None and len(feed.index) == len(feed.tier_index) == 0


def test_a_flood_of_stored_blocks_keeps_the_index_at_its_bound():
    feed = EventFeed(PrefixIndex(1000))
    for seq in range(200):
        feed.apply(seq, batch(stored(*(h(seq * 50 + i) for i in range(50)))))
    assert len(feed.index) == 1000
    assert held(feed, 199 * 50) == 1 and held(feed, 0) == 0


def _publish(socket: zmq.Socket, topic: bytes, seq: int, payload: bytes) -> None:
    socket.send_multipart((topic, seq.to_bytes(8, "big"), payload))


async def test_the_subscription_applies_what_the_engine_publishes_on_its_topic():
    publisher, endpoint = publisher_socket()
    feed = EventFeed(PrefixIndex(100))
    outcomes: list[FeedOutcome] = []
    task = asyncio.create_task(follow(Subscription(endpoint, "kv", feed, outcomes.append)))
    try:
        seq = 0
        while not outcomes:  # a SUB socket misses what is published before it has joined
            _publish(publisher, b"other", seq, batch(stored(h(99))))
            _publish(publisher, b"kv", seq, batch(stored(h(1))))
            seq += 1
            await asyncio.sleep(0.05)
        await until(lambda: held(feed, 1) == 1)
        assert held(feed, 99) == 0
    finally:
        task.cancel()
        publisher.close(linger=0)


async def test_subscriptions_follow_engines_that_join_and_forget_those_that_leave():
    publisher, endpoint = publisher_socket()
    feed = EventFeed(PrefixIndex(100))
    subscriptions = Subscriptions()
    try:
        subscriptions.sync({"prefill/p0": Subscription(endpoint, "", feed)})
        seq = 0
        while held(feed, 1) == 0:
            _publish(publisher, b"", seq, batch(stored(h(1))))
            seq += 1
            await asyncio.sleep(0.05)
        subscriptions.sync({})  # the engine left the config
        await asyncio.sleep(0.2)
        _publish(publisher, b"", seq, batch(stored(h(2))))
        await asyncio.sleep(0.3)
        assert held(feed, 2) == 0
    finally:
        await subscriptions.close()
        publisher.close(linger=0)


@pytest.fixture
def ipc_endpoint() -> Iterator[str]:
    with ports.ipc_endpoint() as endpoint:
        yield endpoint


async def test_a_router_that_starts_after_the_engine_replays_what_it_already_published(ipc_endpoint):
    """vLLM's own publisher, with its replay socket where the operator renders it: what it published before
    anyone subscribed reaches a late subscriber, and live batches continue the sequence without a gap."""
    replay = kv_events_replay_endpoint(ipc_endpoint)
    engine = vllm_events.ZmqEventPublisher(0, endpoint=ipc_endpoint, replay_endpoint=replay, topic="kv")
    try:
        for n in range(5):
            engine.publish(vllm_events.KVEventBatch(ts=time.time(), events=[stored(h(n))]))
        await asyncio.sleep(0.3)  # published into the void: nobody subscribes yet
        feed = EventFeed(PrefixIndex(100))
        outcomes: list[FeedOutcome] = []
        task = asyncio.create_task(follow(Subscription(ipc_endpoint, "kv", feed, outcomes.append, replay)))
        try:
            await until(lambda: held(feed, 0, 1, 2, 3, 4) == 5)
            n = 5
            while held(feed, n - 1) == 0 or n == 5:  # live batches, once the subscription has joined
                engine.publish(vllm_events.KVEventBatch(ts=time.time(), events=[stored(h(n))]))
                n += 1
                await asyncio.sleep(0.05)
            await until(lambda: held(feed, *range(n)) == n)
            assert set(outcomes) == {FeedOutcome.APPLIED}, outcomes
        finally:
            task.cancel()
    finally:
        engine.shutdown()


async def test_an_unanswered_replay_leaves_the_subscription_on_live_events(monkeypatch):
    monkeypatch.setattr(kv_events, "REPLAY_DEADLINE_S", 0.2)
    publisher, endpoint = publisher_socket()
    feed = EventFeed(PrefixIndex(100))
    nobody = kv_events_replay_endpoint(endpoint)  # nothing listens there
    task = asyncio.create_task(follow(Subscription(endpoint, "", feed, None, nobody)))
    try:
        seq = 0
        while held(feed, 1) == 0:
            _publish(publisher, b"", seq, batch(stored(h(1))))
            seq += 1
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        publisher.close(linger=0)
