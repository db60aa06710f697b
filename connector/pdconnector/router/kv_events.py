"""vLLM's KV cache events, as one router follows one engine: a sans-I/O feed that turns published batches
into changes of the engine's :class:`PrefixIndex`, and the ZMQ subscription that reads them.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``) publishes
three-frame messages on a PUB socket: topic, an 8-byte big-endian sequence number, and a msgpack
``[timestamp, [event, ...], data_parallel_rank]`` whose events are maps tagged by ``type``:
``BlockStored`` (``block_hashes``, ``medium``, ...), ``BlockRemoved`` (``block_hashes``, ``medium``) and
``AllBlocksCleared``. The engine's own cache (medium ``GPU``, vLLM's name for its primary pool on every
device, or unset) feeds its index; our connector's KV tier in host memory (medium ``CPU``) feeds a second
one, kept apart because a tier hit is loaded, not free; other media (storage tiers) are not followed.

PUB/SUB drops what a slow subscriber cannot take, and an engine that restarts numbers its batches from 0
again with an empty cache. Either way the index can no longer be trusted, so a gap or a sequence number that
goes back clears it: the engine then looks cold until new events arrive, which costs hits, never answers.
Where the engine keeps vLLM's replay socket (``replay_endpoint``), a new subscription first asks it for the
batches it still buffers, so a router that starts after the engine does not begin blind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pdconnector.router.prefix import PrefixIndex, external_hash

log = logging.getLogger(__name__)

PRIMARY_MEDIA = (None, "GPU")
TIER_MEDIUM = "CPU"
# ZMQ's receive high-water mark: batches queued beyond it are dropped (and seen as a gap), so a flood of
# events cannot grow the router's memory.
RECEIVE_HWM = 10_000
REPLAY_DEADLINE_S = 5.0
REPLAY_END = (-1).to_bytes(8, "big", signed=True)  # vLLM's marker after the last replayed batch


class FeedOutcome(StrEnum):
    APPLIED = "applied"
    GAP = "gap"  # batches were lost: the index was cleared, then this batch applied
    RESTART = "restart"  # the sequence went back: a new engine process, the index starts over
    MALFORMED = "malformed"  # not a batch vLLM publishes: ignored (and the index cleared: it may be behind)


OutcomeHook = Callable[[FeedOutcome], None]


@dataclass
class EventFeed:
    """One engine's event stream applied to its indexes (its cache's and its tier's), in sequence order."""

    index: PrefixIndex
    tier_index: PrefixIndex | None = None
    last_seq: int | None = None
    gaps: int = 0
    restarts: int = 0
    # The engine published a block of its KV tier: it has one, so what is routed there lands in it too. Kept
    # when the indexes are cleared: a tier's events name only what it newly wrote, so after a lost batch the
    # router relearns the prefixes a tier still holds from the prompts routed there.
    has_tier: bool = False

    def reset(self) -> None:
        """Forget everything (the engine restarted or left, or the subscription was re-made)."""
        self.clear()
        self.last_seq = None

    def clear(self) -> None:
        """Forget what the indexes hold: they may be behind the engine."""
        self.index.clear()
        if self.tier_index is not None:
            self.tier_index.clear()

    def apply(self, seq: int, payload: bytes) -> FeedOutcome:
        outcome = FeedOutcome.APPLIED
        if self.last_seq is not None and seq <= self.last_seq:
            self.restarts += 1
            self.clear()
            outcome = FeedOutcome.RESTART
        elif self.last_seq is not None and seq > self.last_seq + 1:
            self.gaps += 1
            self.clear()
            outcome = FeedOutcome.GAP
        self.last_seq = seq
        try:
            events = _events(msgspec.msgpack.decode(payload))
        except (msgspec.DecodeError, ValueError):
            self.clear()
            return FeedOutcome.MALFORMED
        for event in events:
            self._apply_event(event)
        return outcome

    def _apply_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "AllBlocksCleared":  # vLLM's prefix cache reset: the tier keeps its blocks
            self.index.clear()
            return
        medium = event.get("medium")
        self.has_tier = self.has_tier or medium == TIER_MEDIUM
        index = self.index if medium in PRIMARY_MEDIA else self.tier_index if medium == TIER_MEDIUM else None
        if index is None:
            return
        hashes = [external_hash(h) for h in event.get("block_hashes", ())]
        if kind == "BlockStored":
            index.store(hashes)
        elif kind == "BlockRemoved":
            index.remove(hashes)


def _events(batch: object) -> list[dict[str, Any]]:
    """The events of one decoded batch; ``ValueError`` if it is not shaped as vLLM's."""
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("a KV event batch is [timestamp, events, ...]")
    events = batch[1]
    for event in events:
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise ValueError("a KV event is a map with a type")
        hashes = event.get("block_hashes", [])
        if not isinstance(hashes, list) or not all(isinstance(h, bytes | int) for h in hashes):
            raise ValueError("block_hashes is a list of bytes or integers")
    return events


def parse_message(frames: list[bytes]) -> tuple[int, bytes]:
    """``(sequence number, payload)`` of one published message; ``ValueError`` if it has not vLLM's three
    frames."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(f"a KV event message is topic, 8-byte sequence, payload (got {len(frames)} frames)")
    return int.from_bytes(frames[1], "big", signed=True), frames[2]


@dataclass(frozen=True)
class Subscription:
    """What to follow for one engine: its PUB endpoint and topic, and its replay endpoint if it keeps one."""

    endpoint: str
    topic: str
    feed: EventFeed
    on_outcome: OutcomeHook | None = None
    replay_endpoint: str | None = None


def _take(subscription: Subscription, frames: list[bytes], *, skip_seen: bool = False) -> None:
    """Apply one published message; ``skip_seen``: a batch the replay already applied is not news."""
    feed = subscription.feed
    try:
        seq, payload = parse_message(frames)
    except ValueError as error:
        extra = {"endpoint": subscription.endpoint, "error": str(error)}
        log.warning("KV event message ignored", extra=extra)
        feed.clear()
        return
    if skip_seen and feed.last_seq is not None and seq <= feed.last_seq:
        return
    outcome = feed.apply(seq, payload)
    if subscription.on_outcome is not None:
        subscription.on_outcome(outcome)


async def _replay(context: zmq.asyncio.Context, subscription: Subscription, replay_endpoint: str) -> None:
    """Ask the engine for every batch it still buffers (vLLM's replay socket: a request of the first
    sequence number wanted, answered by the batches and an end marker) and apply them, so that a router
    starting after the engine learns what it already holds. Unanswered within the deadline: live events
    only."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IPV6, 1)
    dealer.connect(replay_endpoint)
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        async with asyncio.timeout(REPLAY_DEADLINE_S):
            while True:
                frames = (await dealer.recv_multipart())[1:]  # the envelope's empty delimiter first
                if len(frames) == 3 and frames[1] == REPLAY_END:
                    return
                _take(subscription, frames)
    except TimeoutError:
        log.info("KV event replay unanswered", extra={"endpoint": replay_endpoint})
    finally:
        dealer.close(linger=0)


async def follow(subscription: Subscription) -> None:
    """Subscribe and apply what the engine publishes to the feed until cancelled; with a replay endpoint,
    first what it published before.

    ZMQ reconnects by itself when the engine goes away and comes back; the restart shows as a sequence that
    goes back."""
    context = zmq.asyncio.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IPV6, 1)  # pod addresses may be IPv6
    socket.setsockopt_string(zmq.SUBSCRIBE, subscription.topic)
    socket.connect(subscription.endpoint)
    try:
        if subscription.replay_endpoint is not None:
            await _replay(context, subscription, subscription.replay_endpoint)
            # What was published while the replay ran is queued on the SUB socket, partly replayed already.
            while await socket.poll(0):
                _take(subscription, await socket.recv_multipart(), skip_seen=True)
        while True:
            _take(subscription, await socket.recv_multipart())
    finally:
        socket.close(linger=0)


class Subscriptions:
    """The router's event subscriptions, one task per engine that publishes; re-made when an engine's
    endpoint changes, ended when it leaves."""

    def __init__(self) -> None:
        self._tasks: dict[str, tuple[str, asyncio.Task[None]]] = {}

    def sync(self, wanted: dict[str, Subscription]) -> None:
        """``wanted``: backend key -> what to follow for it."""
        for key in list(self._tasks):
            endpoint, task = self._tasks[key]
            if key not in wanted or wanted[key].endpoint != endpoint:
                task.cancel()
                del self._tasks[key]
                if key in wanted:
                    wanted[key].feed.reset()
        for key, subscription in wanted.items():
            if key not in self._tasks:
                self._tasks[key] = (subscription.endpoint, asyncio.create_task(follow(subscription)))

    async def close(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
