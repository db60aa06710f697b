"""The cache-aware policy's live state: what the router remembers without events, how each router replica
follows the engines' events by itself, and engines that join, leave or restart."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from pdconnector.protocol.params import EngineRole
from pdconnector.router.backends import Backend, BackendPool, BackendSpec
from pdconnector.router.cache_aware import CacheAwareWeights
from pdconnector.router.cache_state import CacheState
from pdconnector.router.config import CacheAware
from pdconnector.router.metrics import RouterMetrics
from pdconnector.router.prefix import BlockHasher, external_hash
from pdconnector.router.selection import Policy, Selector
from pdconnector.router.validation import ClientRequest, Endpoint

from tests.pdconnector.router.kv_event_batches import batch, publisher_socket, stored, until, vllm_events

BLOCK = 16
CONFIG = CacheAware(block_size=BLOCK)
PREFIX = list(range(8 * BLOCK))


def engine(role: EngineRole, name: str, events: str | None) -> BackendSpec:
    return BackendSpec(
        name=name, role=role, host="127.0.0.1", http_port=9, engine_id=name, kv_events_address=events
    )


def prefill(name: str, events: str | None = None) -> BackendSpec:
    return engine(EngineRole.PREFILL, name, events)


def request(tokens: list[int]) -> ClientRequest:
    return ClientRequest(Endpoint.COMPLETIONS, {"model": "m", "prompt": tokens}, stream=False)


def named(pool: BackendPool, name: str) -> Backend:
    return next(backend for backend in pool.all() if backend.name == name)


def pool_of(*specs: BackendSpec) -> BackendPool:
    pool = BackendPool()
    pool.replace(specs)
    return pool


async def blocks(state: CacheState, pool: BackendPool, tokens: list[int]):
    async with aiohttp.ClientSession() as session:
        return await state.prompt_blocks(session, pool, request(tokens))


def choose(pool: BackendPool, prompt) -> str:
    chosen = Selector(Policy.CACHE_AWARE, EngineRole.PREFILL, CacheAwareWeights()).pick(
        list(pool.serving(EngineRole.PREFILL)), prompt
    )
    assert chosen is not None
    return chosen.name


async def test_without_events_a_follow_up_goes_back_to_the_prefill_its_conversation_went_to():
    pool = pool_of(prefill("a"), prefill("b"))
    state = CacheState(CONFIG, RouterMetrics())
    state.track(pool)
    first = await blocks(state, pool, [*PREFIX, 1, 2, 3])
    b = named(pool, "b")
    state.routed(b, first)
    named(pool, "a").outstanding, b.outstanding = 0, 1  # b is busier, but holds the prefix
    follow_up = await blocks(state, pool, [*PREFIX, 1, 2, 3, 9, 9, 9])
    assert follow_up is not None and follow_up.cached_tokens(b) == len(PREFIX)
    assert choose(pool, follow_up) == "b"
    unrelated = await blocks(state, pool, list(range(5000, 5000 + 4 * BLOCK)))
    assert choose(pool, unrelated) == "a"


@pytest.mark.parametrize("role", [EngineRole.PREFILL, EngineRole.DECODE])
async def test_an_engine_with_a_kv_tier_learns_the_prompts_routed_to_it_into_its_tier_index(role: EngineRole):
    """Prefill saves the prompts it computed once their KV left, decode a request's blocks when it ends: their
    tiers' events name only what they newly wrote, so after a lost batch the router relearns from routing."""
    publisher, endpoint = publisher_socket()
    pool = pool_of(prefill("p"), engine(role, "a", endpoint))
    state = CacheState(CONFIG, RouterMetrics())
    learn = state.routed if role is EngineRole.PREFILL else state.decoding
    try:
        state.track(pool)
        a = named(pool, "a")
        prompt = await blocks(state, pool, [*PREFIX, 1, 2, 3])
        assert prompt is not None and a.tier_index is not None
        learn(a, prompt)
        assert len(a.tier_index) == 0  # no sign of a tier yet: only its events could tell
        feed = state.feeds[f"{role.value}/a"]
        feed.apply(0, batch(stored(b"t" * 32, medium="CPU")))  # it published one of its tier's blocks
        feed.apply(2, batch())  # a lost batch: what the router knew of the engine is gone
        learn(a, prompt)
        # vLLM evicts the prompt from the GPU cache (its events remove it there); the tier still serves it
        assert a.prefix_index is not None
        a.prefix_index.remove(prompt.hashes)
        assert (prompt.cached_tokens(a), prompt.tier_tokens(a)) == (0, len(PREFIX))
    finally:
        await state.close()
        publisher.close(linger=0)


async def test_a_prompt_that_cannot_be_tokenized_is_routed_on_load_and_counted():
    pool = pool_of(prefill("a"))
    state = CacheState(CONFIG, RouterMetrics())
    state.track(pool)
    async with aiohttp.ClientSession() as session:
        # text needs the engine's /tokenize, and nothing listens at 127.0.0.1:9 (discard)
        text = ClientRequest(Endpoint.COMPLETIONS, {"model": "m", "prompt": "hello"}, stream=False)
        assert await state.prompt_blocks(session, pool, text) is None
    assert state.metrics.registry.get_sample_value("pd_router_unhashed_prompts_total") == 1


async def test_two_router_replicas_each_follow_the_engine_and_agree_on_what_it_holds():
    publisher, endpoint = publisher_socket()
    hasher = BlockHasher(BLOCK)
    hashes = [h.to_bytes(8, "big") for h in hasher.block_hashes(PREFIX)]
    routers = [(pool_of(prefill("a", endpoint)), CacheState(CONFIG, RouterMetrics())) for _ in range(2)]
    try:
        for pool, state in routers:
            state.track(pool)
        seq = 0
        while not all(
            named(pool, "a").prefix_index.matched_blocks(hasher.block_hashes(PREFIX)) for pool, _ in routers
        ):
            publisher.send_multipart((b"", seq.to_bytes(8, "big"), batch(stored(*hashes))))
            seq += 1
            await asyncio.sleep(0.05)
        for pool, _ in routers:
            assert named(pool, "a").prefix_index.matched_blocks(hasher.block_hashes(PREFIX)) == 8
        # The engine restarts: its sequence starts over, and both replicas forget what the old process held.
        publisher.send_multipart((b"", (0).to_bytes(8, "big"), batch(vllm_events.AllBlocksCleared())))
        for pool, _ in routers:
            await until(lambda pool=pool: len(named(pool, "a").prefix_index) == 0)
    finally:
        for _, state in routers:
            await state.close()
        publisher.close(linger=0)


async def test_engines_that_join_get_an_index_and_those_that_leave_are_no_longer_followed():
    publisher, endpoint = publisher_socket()
    pool = pool_of(prefill("a"))
    state = CacheState(CONFIG, RouterMetrics())
    try:
        state.track(pool)
        pool.replace([prefill("a"), prefill("b", endpoint)])
        state.track(pool)
        assert named(pool, "b").prefix_index is not None and set(state.feeds) == {"prefill/b"}
        pool.replace([prefill("a")])
        state.track(pool)
        assert state.feeds == {}
        # An ejected engine (health checks failed) forgets what it held: it may come back empty.
        a = named(pool, "a")
        a.prefix_index.store([external_hash(b"x" * 32)])
        a.forget_cache()
        assert len(a.prefix_index) == 0
    finally:
        await state.close()
        publisher.close(linger=0)
