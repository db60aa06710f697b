"""The router's front door: input validation, limits, auth, request ids, probes, metrics, config reload."""

from __future__ import annotations

import asyncio
import os

import pytest
from pdconnector.router.app import RouterOptions
from pdconnector.router.config import dump_router_config
from pdconnector.router.health import HealthSettings

MODEL = "tiny"


@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", b'{"prompt": "x"}', 400, "model"),
        ("/v1/completions", b'{"model": "other", "prompt": "x"}', 404, "model"),
        ("/v1/completions", b'{"model": "tiny"}', 400, "prompt"),
        ("/v1/completions", b'{"model": "tiny", "prompt": 5}', 400, "prompt"),
        ("/v1/completions", b'{"model": "tiny", "prompt": [1, -2]}', 400, "prompt"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": "7"}', 400, "max_tokens"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": true}', 400, "max_tokens"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stream": "yes"}', 400, "stream"),
        (
            "/v1/completions",
            b'{"model": "tiny", "prompt": "x", "kv_transfer_params": {}}',
            400,
            "kv_transfer_params",
        ),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400, "messages"),
        (
            "/v1/chat/completions",
            b'{"model": "tiny", "messages": [{"content": "x"}]}',
            400,
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "tiny", "messages": [{"role": "user", "content": 3}]}',
            400,
            "messages[0].content",
        ),
    ],
)
async def test_bad_input_is_a_4xx_naming_the_field_and_reaches_no_engine(  # noqa: PLR0917
    cluster, make_router, path, body, status, field
):
    client = await make_router()
    response = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    assert response.status == status
    error = (await response.json())["error"]
    assert error["message"] and error["type"] and error["code"]
    assert error["param"] == field
    assert not any(e.bodies for e in cluster.prefill + cluster.decode)


async def test_oversized_body_is_rejected_with_413(cluster, make_router):
    client = await make_router(max_request_body_bytes=2048)
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 4096})
    assert response.status == 413
    assert (await response.json())["error"]["code"] == "request_too_large"


async def test_api_key_is_required_on_v1_when_configured(cluster, make_router):
    client = await make_router(options=RouterOptions(api_key="s3cret"))
    body = {"model": MODEL, "prompt": "x"}
    assert (await client.post("/v1/completions", json=body)).status == 401
    assert (
        await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
    ).status == 401
    assert (await client.get("/v1/models")).status == 401
    assert (
        await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
    ).status == 200
    assert (await client.get("/health")).status == 200


async def test_request_id_is_propagated_to_both_legs_and_generated_when_absent(cluster, make_router):
    client = await make_router()
    response = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"X-Request-Id": "abc-123"}
    )
    assert response.headers["X-Request-Id"] == "abc-123"
    generated = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert len(generated.headers["X-Request-Id"]) == 32
    errored = await client.post("/v1/completions", data=b"{")
    assert errored.headers["X-Request-Id"]


async def test_models_lists_the_served_model(make_router):
    client = await make_router()
    body = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in body["data"]] == [MODEL]


async def test_metrics_count_requests_by_mode_and_outcome(cluster, make_router):
    client = await make_router(mode="pull")
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    await (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})).read()
    text = await (await client.get("/metrics")).text()
    assert 'pd_router_requests_total{mode="pull",outcome="ok"} 2.0' in text
    assert 'pd_router_ttft_seconds_count{mode="pull"} 1.0' in text
    assert 'pd_router_request_duration_seconds_count{mode="pull"} 2.0' in text
    assert 'pd_router_transfers_total{result="verified"} 2.0' in text


async def test_config_file_changes_are_applied_live_and_broken_files_ignored(cluster, make_router, tmp_path):
    path = tmp_path / "router.yaml"
    one_decode = cluster.config(
        decode={
            "service": "s",
            "namespace": "default",
            "http_port": cluster.decode_port,
            "replicas": 1,
            "backends": [{"name": "d1", "host": cluster.decode[1].host, "engine_id": "d1-c0ffee"}],
        }
    )
    path.write_text(dump_router_config(cluster.config()))
    options = RouterOptions(config_path=path, refresh_interval_s=0.05, health=HealthSettings(interval_s=0.05))
    client = await make_router(options=options)

    async def decode_names() -> list[str]:
        status = await (await client.get("/status")).json()
        return sorted(b["name"] for b in status["backends"] if b["role"] == "decode")

    assert await decode_names() == ["d0", "d1"]
    path.write_text(dump_router_config(one_decode))
    os.utime(path, (1, 1))  # a different mtime even on coarse clocks
    for _ in range(40):
        if await decode_names() == ["d1"]:
            break
        await asyncio.sleep(0.05)
    assert await decode_names() == ["d1"]
    path.write_text("mode: [broken")
    await asyncio.sleep(0.3)
    assert await decode_names() == ["d1"]
    for _ in range(3):
        assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})).headers[
            "x-pd-decode"
        ] == "d1"


async def test_assistant_turn_without_content_is_accepted(cluster, make_router):
    client = await make_router()
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "again"},
    ]
    assert (
        await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    ).status == 200
