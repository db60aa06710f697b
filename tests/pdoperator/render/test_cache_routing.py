"""The cache-aware policy rendered: engines publish vLLM's KV cache events with the block size the router
hashes with, the router subscribes, and the NetworkPolicy admits exactly that traffic."""

from __future__ import annotations

import json

import pytest
from pdoperator.render import RenderDefaults, build_router_config, render_pdservice

from tests.pdoperator.render.conftest import VARIANTS, pds_from_spec

CACHE_AWARE = {"policy": "cache-aware"}


def _objects(pds):
    return {(o["kind"], o["metadata"]["name"]): o for o in render_pdservice(pds, RenderDefaults())}


def _engine(objects, role):
    return objects["StatefulSet", f"svc-{role}"]["spec"]["template"]["spec"]["containers"][0]


def _flag(args, flag):
    return args[args.index(flag) + 1]


def test_both_roles_publish_their_cache_with_the_policys_block_size():
    objects = _objects(pds_from_spec(VARIANTS["cache-aware"]))
    for role in ("prefill", "decode"):
        container = _engine(objects, role)
        assert _flag(container["args"], "--block-size") == "32"
        assert json.loads(_flag(container["args"], "--kv-events-config")) == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
            "topic": "kv-events",
        }
        assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in container["ports"]
        assert {"name": "kv-replay", "containerPort": 5558, "protocol": "TCP"} in container["ports"]
        # vLLM's default (on) stands: prefix caching is what the policy routes to
        assert "--no-enable-prefix-caching" not in container["args"]


def test_the_router_hashes_as_the_engines_do_and_subscribes_to_both_roles():
    config = build_router_config(pds_from_spec(VARIANTS["cache-aware"]), RenderDefaults())
    assert config.policy == "cache-aware"
    assert config.cache_aware is not None
    assert (config.cache_aware.block_size, config.cache_aware.hash_algorithm) == (32, "sha256")
    assert config.cache_aware.hash_seed == "42"
    assert config.cache_aware.kv_events_topic == "kv-events"
    assert config.cache_aware.kv_events_replay  # a router that starts late asks the engines what they hold
    assert config.cache_aware.max_imbalance == 2
    assert config.prefill.kv_events_port == config.decode.kv_events_port == 5557


@pytest.mark.parametrize(("percent", "weight"), [(None, 0.8), (50, 0.5), (0, 0.0)])
def test_a_token_in_an_engines_kv_tier_weighs_tier_weight_percent_of_a_cached_one(
    percent: int | None, weight: float
) -> None:
    cache_aware = {**VARIANTS["cache-aware"]["router"]["cacheAware"]}
    if percent is not None:
        cache_aware["tierWeightPercent"] = percent
    spec = {
        **VARIANTS["cache-aware"],
        "router": {**VARIANTS["cache-aware"]["router"], "cacheAware": cache_aware},
    }
    config = build_router_config(pds_from_spec(spec), RenderDefaults())
    assert config.cache_aware is not None and config.cache_aware.tier_weight == weight


def test_the_router_alone_is_admitted_to_the_events_and_replay_ports():
    policy = _objects(pds_from_spec(VARIANTS["cache-aware"]))["NetworkPolicy", "svc-engines"]["spec"]
    _, router, *others = policy["ingress"]
    events = [{"protocol": "TCP", "port": 5557}, {"protocol": "TCP", "port": 5558}]
    assert router["ports"] == [{"protocol": "TCP", "port": 8000}, *events]
    assert all(port not in rule.get("ports", []) for rule in others for port in events)


def test_mock_engines_publish_nothing_and_the_router_remembers_what_it_routed():
    spec = {
        **VARIANTS["cache-aware"],
        "engine": {"runtime": "mock", "transport": {"backend": "mock"}},
        "prefill": {"resources": {"gpus": 0}},
        "decode": {"resources": {"gpus": 0}},
    }
    pds = pds_from_spec(spec)
    config = build_router_config(pds, RenderDefaults())
    assert config.cache_aware is not None and config.cache_aware.block_size == 32
    assert config.prefill.kv_events_port is None and config.decode.kv_events_port is None
    assert not config.cache_aware.kv_events_replay
    assert "--kv-events-config" not in _engine(_objects(pds), "prefill")["args"]


def test_another_policy_renders_none_of_it():
    objects = _objects(pds_from_spec(VARIANTS["gpu-push-ucx"]))
    assert "--kv-events-config" not in _engine(objects, "prefill")["args"]
    assert all(port["name"] != "kv-events" for port in _engine(objects, "decode")["ports"])
    assert build_router_config(pds_from_spec(VARIANTS["gpu-push-ucx"]), RenderDefaults()).cache_aware is None


def test_the_block_size_is_part_of_what_prefill_and_decode_must_agree_on():
    def compat(block_size):
        router = {**CACHE_AWARE, "cacheAware": {"blockSize": block_size}}
        spec = {**VARIANTS["gpu-push-ucx"], "router": router}
        return build_router_config(pds_from_spec(spec), RenderDefaults()).compat_hash

    assert compat(32) != compat(64)
