"""The cache-aware policy's two ends: the engines publish vLLM's KV cache events, the router subscribes and
hashes prompts exactly as the engines do (block size, hash function and seed)."""

from __future__ import annotations

import json
from typing import Any

from pdconnector.router.config import CacheAware, kv_events_replay_endpoint

from pdoperator.api.model import PDServiceSpec, Runtime
from pdoperator.api.routing import CacheAwareSpec, RoutingPolicy

KV_EVENTS_PORT = 5557
KV_EVENTS_REPLAY_PORT = KV_EVENTS_PORT + 1  # kv_events_replay_endpoint's convention
KV_EVENTS_PORT_NAME = "kv-events"
KV_EVENTS_REPLAY_PORT_NAME = "kv-replay"
KV_EVENTS_TOPIC = "kv-events"
# vLLM's default --prefix-caching-hash-algo; validation keeps users from changing it under this policy.
HASH_ALGORITHM = "sha256"
HASH_SEED_ENV = "PYTHONHASHSEED"


def cache_aware_spec(spec: PDServiceSpec) -> CacheAwareSpec | None:
    """The policy's settings (its defaults where the spec gives none); None under another policy."""
    if spec.router.policy is not RoutingPolicy.CACHE_AWARE:
        return None
    return spec.router.cache_aware or CacheAwareSpec()


def publishes_kv_events(spec: PDServiceSpec) -> bool:
    """vLLM engines under the cache-aware policy publish their cache; mock engines publish nothing (the router
    then remembers what it routed)."""
    return cache_aware_spec(spec) is not None and spec.engine.runtime is Runtime.VLLM


def kv_events_container_ports(spec: PDServiceSpec) -> list[dict[str, Any]]:
    """The engine container's events and replay ports, where it publishes."""
    if not publishes_kv_events(spec):
        return []
    named = ((KV_EVENTS_PORT_NAME, KV_EVENTS_PORT), (KV_EVENTS_REPLAY_PORT_NAME, KV_EVENTS_REPLAY_PORT))
    return [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in named]


def engine_block_size(spec: PDServiceSpec) -> int | None:
    """The ``--block-size`` the operator renders onto both roles, if it renders one."""
    settings = cache_aware_spec(spec)
    return settings.block_size if settings is not None and publishes_kv_events(spec) else None


def kv_events_args(spec: PDServiceSpec) -> list[str]:
    """vLLM flags of an engine under the cache-aware policy. vLLM binds a wildcard endpoint (one with a host
    it would connect to instead); each pod has its own network namespace, so every pod keeps the same port."""
    if (block_size := engine_block_size(spec)) is None:
        return []
    endpoint = f"tcp://*:{KV_EVENTS_PORT}"
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": kv_events_replay_endpoint(endpoint),
        "topic": KV_EVENTS_TOPIC,
    }
    return ["--block-size", str(block_size), "--kv-events-config", json.dumps(events, separators=(",", ":"))]


def hash_seed(spec: PDServiceSpec) -> str | None:
    """The engines' PYTHONHASHSEED, which seeds vLLM's block hashes (validation keeps both roles equal)."""
    return next((var.value for var in spec.prefill.env if var.name == HASH_SEED_ENV), None)


def router_cache_aware(spec: PDServiceSpec) -> CacheAware | None:
    """The router config's ``cache_aware`` section."""
    settings = cache_aware_spec(spec)
    if settings is None:
        return None
    return CacheAware(
        block_size=settings.block_size,
        hash_algorithm=HASH_ALGORITHM,
        hash_seed=hash_seed(spec),
        kv_events_topic=KV_EVENTS_TOPIC,
        kv_events_replay=publishes_kv_events(spec),
        prefix_weight=settings.prefix_weight,
        tier_weight=settings.tier_weight_percent / 100,
        load_weight=settings.load_weight,
        max_imbalance=settings.max_imbalance,
        kv_usage_weight=settings.kv_usage_weight,
    )
