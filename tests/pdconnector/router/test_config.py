"""The router config file: what the operator writes and the router loads."""

from __future__ import annotations

import pytest
from pdconnector.router.config import (
    EngineBackend,
    RoleBackends,
    RouterConfig,
    Timeouts,
    dump_router_config,
    kv_events_replay_endpoint,
    load_router_config,
    parse_router_config,
)
from pydantic import ValidationError


def role(name: str, replicas: int, tp: int = 1) -> RoleBackends:
    return RoleBackends(
        service=f"svc-{name}.ns.svc.cluster.local",
        namespace="ns",
        tp_size=tp,
        replicas=replicas,
        backends=[
            EngineBackend(
                name=f"svc-{name}-{i}",
                host=f"svc-{name}-{i}.svc-{name}.ns.svc.cluster.local",
                engine_id=f"svc-{name}-{i}-abc",
            )
            for i in range(replicas)
        ],
    )


def config(**overrides) -> RouterConfig:
    fields = {
        "name": "svc",
        "namespace": "ns",
        "mode": "push",
        "served_model_name": "m",
        "compat_hash": "abc",
        "prefill": role("prefill", 2, tp=2),
        "decode": role("decode", 1, tp=4),
    }
    return RouterConfig(**(fields | overrides))


def test_a_dumped_config_loads_back_equal(tmp_path):
    original = config(
        api_key_env="KEY",
        policy="round-robin",
        timeouts=Timeouts(prefill_s=3, transfer_s=2),
        max_model_len=2048,
    )
    path = tmp_path / "router.yaml"
    path.write_text(dump_router_config(original))
    assert load_router_config(path) == original
    assert load_router_config(str(path)) == original


def test_dumping_is_stable_text():
    assert dump_router_config(config()) == dump_router_config(config())
    assert dump_router_config(config()).startswith("name: svc\nnamespace: ns\nmode: push\n")


def test_defaults_cover_everything_but_identity_and_backends():
    cfg = config()
    assert (cfg.policy, cfg.connector, cfg.listen_port, cfg.api_key_env) == (
        "least-loaded",
        "builtin",
        8000,
        None,
    )
    # spec.model.maxModelLen unset: the model's own length, which only the engines know
    assert cfg.max_model_len is None
    assert cfg.timeouts == Timeouts(
        connect_s=5.0, prefill_s=120.0, transfer_s=60.0, decode_first_token_s=60.0
    )
    assert cfg.max_request_body_bytes == 8 * 1024 * 1024
    assert (cfg.prefill.http_port, cfg.prefill.side_channel_port) == (8000, 5600)


def test_every_replica_has_exactly_one_backend():
    with pytest.raises(ValidationError, match="replicas is 3 but 2 backends are listed"):
        RoleBackends(service="s", namespace="ns", replicas=3, backends=role("prefill", 2).backends)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("mode: [", "not valid YAML"),
        ("- a\n- b\n", "must be a YAML mapping"),
        ("", "must be a YAML mapping"),
    ],
)
def test_text_that_is_not_a_config_mapping_is_a_value_error(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_router_config(text)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"mode": "sideways"}, "mode"),
        ({"policy": "random"}, "policy"),
        ({"listen_port": 0}, "listen_port"),
        ({"unknown": 1}, "unknown"),
        ({"timeouts": {"prefill_s": 0}}, "timeouts.prefill_s"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"max_model_len": 10_485_761}, "max_model_len"),
        ({"prefill": {"service": "s", "namespace": "n", "replicas": 1, "backends": []}}, "prefill"),
    ],
)
def test_invalid_fields_are_rejected_by_name(change, field):
    data = config().model_dump(mode="json") | change
    with pytest.raises(ValidationError) as error:
        RouterConfig.model_validate(data)
    assert field in str(error.value)


def test_a_missing_file_raises_os_error(tmp_path):
    with pytest.raises(OSError):
        load_router_config(tmp_path / "absent.yaml")


def test_configs_are_immutable():
    with pytest.raises(ValidationError):
        config().mode = "pull"


@pytest.mark.parametrize(
    ("events", "replay"),
    [
        ("tcp://*:5557", "tcp://*:5558"),
        (
            "tcp://tiny-prefill-0.tiny-prefill.default.svc:5557",
            "tcp://tiny-prefill-0.tiny-prefill.default.svc:5558",
        ),
        ("tcp://[fd00::1]:5557", "tcp://[fd00::1]:5558"),
        ("ipc:///tmp/pd-1a2b.kv", "ipc:///tmp/pd-1a2b.kv-replay"),
    ],
)
def test_an_engines_replay_socket_is_next_to_its_events_endpoint(events, replay):
    assert kv_events_replay_endpoint(events) == replay


def test_an_events_endpoint_without_a_port_has_no_replay_socket_to_name():
    with pytest.raises(ValueError, match="neither tcp://HOST:PORT nor ipc://PATH"):
        kv_events_replay_endpoint("tcp://engine")
