"""The cache-aware policy's live side: hashing each request's prompt before it is routed, keeping each
engine's prefix index fed (its KV events, and the prompts routed to it)."""

from __future__ import annotations

import aiohttp

from pdconnector.protocol.params import EngineRole
from pdconnector.router.backends import Backend, BackendPool
from pdconnector.router.cache_aware import CacheAwareWeights, PromptBlocks
from pdconnector.router.config import CacheAware, kv_events_replay_endpoint
from pdconnector.router.kv_events import EventFeed, FeedOutcome, OutcomeHook, Subscription, Subscriptions
from pdconnector.router.metrics import RouterMetrics
from pdconnector.router.prefix import BlockHasher, PrefixIndex
from pdconnector.router.tokens import prompt_token_ids
from pdconnector.router.validation import ClientRequest


def weights_of(config: CacheAware) -> CacheAwareWeights:
    return CacheAwareWeights(
        prefix_weight=config.prefix_weight,
        tier_weight=config.tier_weight,
        load_weight=config.load_weight,
        max_imbalance=config.max_imbalance,
        kv_usage_weight=config.kv_usage_weight,
    )


def _key(backend: Backend) -> str:
    return f"{backend.spec.role.value}/{backend.name}"


class CacheState:
    def __init__(self, config: CacheAware, metrics: RouterMetrics) -> None:
        self.config = config
        self.hasher = BlockHasher(config.block_size, config.hash_algorithm, config.hash_seed)
        self.metrics = metrics
        self.feeds: dict[str, EventFeed] = {}
        self.subscriptions = Subscriptions()

    def track(self, pool: BackendPool) -> None:
        """Give every backend an index and follow the events of those that publish; forget backends that
        left. Needs a running event loop once any backend publishes."""
        wanted = {}
        for backend in pool.all():
            key = _key(backend)
            if backend.prefix_index is None:
                backend.prefix_index = PrefixIndex(self.config.index_blocks)
            endpoint = backend.spec.kv_events_endpoint
            if endpoint is None:
                continue
            if backend.tier_index is None:  # only events tell what a tier holds
                backend.tier_index = PrefixIndex(self.config.index_blocks)
            feed = self.feeds.get(key)
            if (
                feed is None
                or feed.index is not backend.prefix_index
                or feed.tier_index is not backend.tier_index
            ):
                feed = self.feeds[key] = EventFeed(backend.prefix_index, backend.tier_index)
            wanted[key] = Subscription(
                endpoint,
                self.config.kv_events_topic,
                feed,
                self._counter(backend),
                kv_events_replay_endpoint(endpoint) if self.config.kv_events_replay else None,
            )
        for key in set(self.feeds) - set(wanted):
            del self.feeds[key]
        self.subscriptions.sync(wanted)

    def _counter(self, backend: Backend) -> OutcomeHook:
        counter = self.metrics.kv_event_batches

        def count(outcome: FeedOutcome) -> None:
            counter.labels(backend.spec.role.value, backend.name, outcome.value).inc()

        return count

    async def prompt_blocks(
        self, session: aiohttp.ClientSession, pool: BackendPool, request: ClientRequest
    ) -> PromptBlocks | None:
        """The request's prompt blocks, tokenized by the least busy prefill; None when it cannot be now."""
        tokenizer = min(pool.serving(EngineRole.PREFILL), key=lambda b: (b.outstanding, b.name), default=None)
        tokens = await prompt_token_ids(session, tokenizer, request)
        if tokens is None:
            self.metrics.unhashed_prompts.inc()
            return None
        return PromptBlocks(len(tokens), self.hasher.block_size, tuple(self.hasher.block_hashes(tokens)))

    def routed(self, prefill: Backend, prompt: PromptBlocks | None) -> None:
        """``prefill`` takes this prompt: count what it is expected to find cached, and remember that it will
        hold these blocks.

        Also where the engine publishes events: they report blocks once computed, so a follow-up sent while
        this prompt is still being prefilled would otherwise miss them (and its prefix be computed twice, on
        two engines). What the engine evicts, its events remove. A prefill with a KV tier saves the prompts
        it computed there once their KV left, so its tier index learns them too."""
        if prompt is None:
            return
        self.metrics.prefix_tokens.labels("prompt").inc(prompt.token_count)
        self.metrics.prefix_tokens.labels("cached").inc(prompt.cached_tokens(prefill))
        self.metrics.prefix_tokens.labels("tier").inc(prompt.tier_tokens(prefill))
        if prefill.prefix_index is not None:
            prefill.prefix_index.store(prompt.hashes)
        self._learn_tier(prefill, prompt)

    def decoding(self, decode: Backend, prompt: PromptBlocks | None) -> None:
        """``decode`` started answering this prompt. A decode with a KV tier saves the request's blocks there
        when it ends normally, so its tier index learns the prompt's now (optimistically: events remove what
        the tier evicts): the tier's events name only what it newly wrote, so after a lost batch or an index
        reset the router would not know the conversations it still holds."""
        if prompt is not None:
            self._learn_tier(decode, prompt)

    def _learn_tier(self, backend: Backend, prompt: PromptBlocks) -> None:
        """Remember the prompt in ``backend``'s tier index once the engine has shown it has a tier (only its
        events can tell)."""
        feed = self.feeds.get(_key(backend))
        if feed is not None and feed.has_tier and backend.tier_index is not None:
            backend.tier_index.store(prompt.hashes)

    async def close(self) -> None:
        await self.subscriptions.close()
