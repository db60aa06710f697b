"""The router's view of an engine's cache, checked against a real vLLM CPU engine: the KV cache events it
publishes name exactly the block hashes the router computes from the prompt's tokens (as the engine's own
``/tokenize`` gives them), whether the prompt came as text or as token ids, with vLLM's default seed and
with a ``PYTHONHASHSEED``; and a router that subscribes late learns the same from the engine's replay
socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from pdconnector.router.config import kv_events_replay_endpoint
from pdconnector.router.kv_events import EventFeed, FeedOutcome, Subscription, follow, parse_message
from pdconnector.router.prefix import BlockHasher, PrefixIndex
from pdconnector.sim.tokenizer import words

from tests.pdconnector.vllm.harness import EngineLauncher, complete
from tests.pdconnector.vllm.pd_engines import prompt_of
from tests.ports import ipc_endpoint

pytestmark = pytest.mark.slow

BLOCK_SIZE = 32
TOPIC = "kv-events"
EVENTS_DEADLINE_S = 30.0


def events_config(endpoint: str) -> str:
    """As the operator renders it: events, and vLLM's replay socket where the router expects it."""
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": TOPIC}
    return json.dumps({**events, "replay_endpoint": kv_events_replay_endpoint(endpoint)})


async def held_by_a_late_router(endpoint: str, hashes: list[int]) -> int:
    """How many of ``hashes`` a router that subscribes only now learns the engine holds (its replay)."""
    feed = EventFeed(PrefixIndex(100_000))
    subscription = Subscription(endpoint, TOPIC, feed, replay_endpoint=kv_events_replay_endpoint(endpoint))
    task = asyncio.create_task(follow(subscription))
    try:
        deadline = time.monotonic() + EVENTS_DEADLINE_S
        while feed.index.matched_blocks(hashes) < len(hashes) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return feed.index.matched_blocks(hashes)
    finally:
        task.cancel()


@pytest.fixture
def endpoint() -> Iterator[str]:
    with ipc_endpoint() as path:
        yield path


@contextlib.contextmanager
def subscribed(endpoint: str) -> Iterator[tuple[zmq.Socket, EventFeed]]:
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    socket.connect(endpoint)
    try:
        yield socket, EventFeed(PrefixIndex(100_000))
    finally:
        socket.close(linger=0)
        context.term()


def drain_until(socket: zmq.Socket, feed: EventFeed, hashes: list[int]) -> int:
    """Apply published batches until ``hashes`` are all held (or the deadline); returns how many lead."""
    deadline = time.monotonic() + EVENTS_DEADLINE_S
    while feed.index.matched_blocks(hashes) < len(hashes) and time.monotonic() < deadline:
        if socket.poll(200):
            seq, payload = parse_message(socket.recv_multipart())
            assert feed.apply(seq, payload) in {FeedOutcome.APPLIED}
    return feed.index.matched_blocks(hashes)


def tokenize(url: str, prompt: str) -> list[int]:
    body = json.dumps({"model": "tiny", "prompt": prompt}).encode()
    request = urllib.request.Request(
        f"{url}/tokenize", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["tokens"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", [None, "1234"], ids=["vllm-default-seed", "pythonhashseed"])
def test_published_block_hashes_are_the_routers_hashes_of_the_prompt(
    seed: str | None, endpoint: str, dense_model: Path, launch_engine: EngineLauncher
) -> None:
    server = launch_engine(
        f"kv-events-{seed or 'default'}",
        dense_model,
        env={"PYTHONHASHSEED": seed} if seed else {},
        block_size=BLOCK_SIZE,
        extra_args=("--enable-prefix-caching", "--kv-events-config", events_config(endpoint)),
    )
    hasher = BlockHasher(BLOCK_SIZE, "sha256", seed)
    with subscribed(endpoint) as (socket, feed):
        server.wait_healthy(300)
        # A ZMQ subscriber misses what is published before its subscription reaches the engine: warm up first.
        complete(server.url, prompt_of(BLOCK_SIZE, 3), max_tokens=1)
        time.sleep(1.0)

        token_prompt = prompt_of(5 * BLOCK_SIZE + 7, 1)
        complete(server.url, token_prompt, max_tokens=1)
        expected = hasher.block_hashes(token_prompt)
        assert len(expected) == 5
        assert drain_until(socket, feed, expected) == 5

        text = words(prompt_of(3 * BLOCK_SIZE + 1, 2))
        tokens = tokenize(server.url, text)
        complete(server.url, text, max_tokens=1)
        expected = hasher.block_hashes(tokens)
        assert len(expected) == 3
        assert drain_until(socket, feed, expected) == 3
        # A different seed hashes to other blocks: the match is not an accident of the index.
        other = BlockHasher(BLOCK_SIZE, "sha256", "other-seed")
        assert feed.index.matched_blocks(other.block_hashes(tokens)) == 0
    # A router that starts now, after both prompts, learns both from the engine's replay socket.
    both = hasher.block_hashes(token_prompt) + hasher.block_hashes(tokens)
    assert asyncio.run(held_by_a_late_router(endpoint, both)) == 8
