"""Fake engines (small aiohttp apps bound to distinct loopback addresses) and a router wired to them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pdconnector.protocol.params import RECEIVED_KEY
from pdconnector.router.app import RouterOptions, create_app
from pdconnector.router.config import RouterConfig, Timeouts
from pdconnector.router.health import HealthSettings

from tests.ports import free_port

MODEL = "tiny"


CANNED_ANSWERS: dict[str, tuple[int, dict[str, Any]]] = {
    "error500": (500, {"error": {"message": "engine exploded", "code": "boom"}}),
    "reject400": (400, {"error": {"message": "prompt too long", "code": "bad"}}),
    "transfer_failed": (504, {"error": {"message": "no KV within 1 s", "code": "kv_transfer_timeout"}}),
    # What our connector's prefill answers when it cannot keep the KV for decode: a success status, the error
    # in the body.
    "pd_error": (
        200,
        {"choices": [{"index": 0, "text": " t1"}], "kv_transfer_params": {"pd_error": "transfer_id missing"}},
    ),
    # What vLLM answers for a request it dropped at shutdown (SIGTERM).
    "aborted": (200, {"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}),
}
KV_WAIT_S = 5.0  # a decode with kv_sources fails the transfer after this long, as a transfer timeout does


@dataclass
class FakeEngine:
    """An engine whose behaviour a test sets: answer normally, fail, hang, or stream chunks."""

    name: str
    role: str
    host: str
    # ok | hang | die_mid_stream | stall_mid_stream (after its first event) | stream_error (its only event) |
    # one of CANNED_ANSWERS
    behaviour: str = "ok"
    bodies: list[dict[str, Any]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)  # a hanging handler waits on this
    wait_for: FakeEngine | None = (
        None  # answer only after this engine got a request (proves concurrent dispatch)
    )
    health_status: int = 200
    health_body: dict[str, Any] = field(default_factory=lambda: {"status": "ok"})
    health_stalls: float = 0  # this many of the next /health calls never answer (math.inf: all of them)
    stream_reports: bool = (
        True  # the final stream event carries kv_transfer_params, as the mock engine's do (vLLM's never)
    )
    # decode: answer only once one of these prefills answered the request's transfer, as a real decode waits
    # for its KV (else fail it as a transfer timeout after KV_WAIT_S)
    kv_sources: list[FakeEngine] = field(default_factory=list)
    prefilled: set[str] = field(default_factory=set)  # prefill: the transfers it answered

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, _: web.Request) -> web.Response:
        if self.health_stalls > 0:
            self.health_stalls -= 1
            await self.release.wait()
        return web.json_response(self.health_body, status=self.health_status)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.arrived.set()
        try:
            if self.wait_for is not None:
                await asyncio.wait_for(self.wait_for.arrived.wait(), 5)
            if self.behaviour == "hang":
                await self.release.wait()
            if self.behaviour in CANNED_ANSWERS:
                status, answer = CANNED_ANSWERS[self.behaviour]
                return web.json_response(answer, status=status)
            if self.role == "prefill":
                answer = self.prefill_answer(body)
                self.prefilled.add(body["kv_transfer_params"]["transfer_id"])
                return web.json_response(answer)
            if self.kv_sources and not await self.kv_arrived(body["kv_transfer_params"]["transfer_id"]):
                status, answer = CANNED_ANSWERS["transfer_failed"]
                return web.json_response(answer, status=status)
            if body.get("stream"):
                return await self.stream(request, body)
            return web.json_response(self.decode_answer(body))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def kv_arrived(self, transfer_id: str) -> bool:
        deadline = asyncio.get_running_loop().time() + KV_WAIT_S
        while not any(transfer_id in source.prefilled for source in self.kv_sources):
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def prefill_answer(self, body: dict[str, Any]) -> dict[str, Any]:
        params = body["kv_transfer_params"]
        returned = {
            "do_remote_prefill": True,
            "remote_block_ids": [[1, 2]],
            "remote_engine_id": self.name,
            "remote_host": self.host,
            "remote_port": 5600,
        }
        return {
            "choices": [{"index": 0, "text": " t1"}],
            "kv_transfer_params": returned if params.get("transfer_mode") == "pull" else None,
        }

    def decode_answer(self, body: dict[str, Any]) -> dict[str, Any]:
        tid = body["kv_transfer_params"]["transfer_id"]
        return {
            "choices": [{"index": 0, "text": " t1 t2 t3", "finish_reason": "length"}],
            "kv_transfer_params": {RECEIVED_KEY: {"transfer_id": tid}},
        }

    async def stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.behaviour == "stream_error":  # how vLLM streams a request that failed (a failed KV load)
            error = {"message": "Internal server error", "type": "InternalServerError", "code": 500}
            await response.write(b"data: " + json.dumps({"error": error}).encode() + b"\n\ndata: [DONE]\n\n")
            return response
        for index in range(3):
            chunk: dict[str, Any] = {"choices": [{"index": 0, "text": f" t{index}", "finish_reason": None}]}
            if index == 2:
                chunk["choices"][0]["finish_reason"] = "length"
            if index == 2 and self.stream_reports:
                chunk["kv_transfer_params"] = {
                    RECEIVED_KEY: {"transfer_id": body["kv_transfer_params"]["transfer_id"]}
                }
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if self.behaviour == "die_mid_stream" and index == 1:
                request.transport.close()  # type: ignore[union-attr]
                return response
            if self.behaviour == "stall_mid_stream":
                await self.release.wait()
            await asyncio.sleep(0.01)
        await response.write(b"data: [DONE]\n\n")
        return response


def router_config(
    prefill_engines: list[FakeEngine],
    decode_engines: list[FakeEngine],
    ports: tuple[int, int],
    **overrides: Any,
) -> RouterConfig:
    def role(engines: list[FakeEngine], service: str, port: int) -> dict[str, Any]:
        backends = [{"name": e.name, "host": e.host, "engine_id": f"{e.name}-c0ffee"} for e in engines]
        return {
            "service": service,
            "namespace": "default",
            "http_port": port,
            "replicas": len(engines),
            "backends": backends,
        }

    data: dict[str, Any] = {
        "name": "tiny",
        "namespace": "default",
        "mode": "push",
        "served_model_name": MODEL,
        "compat_hash": "c0ffee",
        "prefill": role(prefill_engines, "tiny-prefill", ports[0]),
        "decode": role(decode_engines, "tiny-decode", ports[1]),
        "timeouts": Timeouts(connect_s=1, prefill_s=2, decode_first_token_s=2, transfer_s=1).model_dump(),
    }
    data.update(overrides)
    return RouterConfig.model_validate(data)


@dataclass
class Cluster:
    prefill: list[FakeEngine]
    decode: list[FakeEngine]
    prefill_port: int
    decode_port: int
    servers: dict[str, TestServer]

    def config(self, *, decode_engines: list[FakeEngine] | None = None, **overrides: Any) -> RouterConfig:
        """The router's config for these engines (``decode_engines``: only those decodes)."""
        decode = self.decode if decode_engines is None else decode_engines
        return router_config(self.prefill, decode, (self.prefill_port, self.decode_port), **overrides)

    async def stop(self, engine: FakeEngine) -> None:
        await self.servers[engine.name].close()

    async def start(self, engine: FakeEngine) -> None:
        """Serve a stopped engine again, at its old address."""
        port = self.prefill_port if engine.role == "prefill" else self.decode_port
        self.servers[engine.name] = TestServer(engine.app(), host=engine.host, port=port)
        await self.servers[engine.name].start_server()


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    prefill = [FakeEngine(f"p{i}", "prefill", f"127.0.0.{10 + i}") for i in range(2)]
    decode = [FakeEngine(f"d{i}", "decode", f"127.0.0.{20 + i}") for i in range(2)]
    prefill_port = free_port(*(e.host for e in prefill))
    decode_port = free_port(*(e.host for e in decode))
    servers = {}
    for engines, port in ((prefill, prefill_port), (decode, decode_port)):
        for engine in engines:
            server = TestServer(engine.app(), host=engine.host, port=port)
            await server.start_server()
            servers[engine.name] = server
    yield Cluster(prefill, decode, prefill_port, decode_port, servers)
    for engine in prefill + decode:
        engine.release.set()
    for server in servers.values():
        await server.close()


RouterFactory = Callable[..., "asyncio.Future[TestClient]"]


@pytest.fixture
async def make_router(cluster: Cluster) -> AsyncIterator[Callable[..., Any]]:
    clients: list[TestClient] = []

    async def make(options: RouterOptions | None = None, **overrides: Any) -> TestClient:
        options = options or RouterOptions(
            health=HealthSettings(interval_s=0.1, timeout_s=0.5, failures_to_eject=1), refresh_interval_s=0.1
        )
        client = TestClient(TestServer(create_app(cluster.config(**overrides), options)))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


@pytest.fixture(scope="module")
def threaded_router() -> Iterator[str]:
    """A router with healthy fake engines on its own event loop thread, for synchronous (hypothesis) tests:
    its base URL."""
    loop = asyncio.new_event_loop()
    ready: concurrent.futures.Future[str] = concurrent.futures.Future()
    stop = asyncio.Event()

    async def serve() -> None:
        prefill = [FakeEngine("p0", "prefill", "127.0.0.30")]
        decode = [FakeEngine("d0", "decode", "127.0.0.31")]
        ports = (free_port("127.0.0.30"), free_port("127.0.0.31"))
        servers = [
            TestServer(prefill[0].app(), host="127.0.0.30", port=ports[0]),
            TestServer(decode[0].app(), host="127.0.0.31", port=ports[1]),
        ]
        router = TestServer(
            create_app(router_config(prefill, decode, ports, max_request_body_bytes=4096), RouterOptions()),
            host="127.0.0.1",
        )
        for server in [*servers, router]:
            await server.start_server()
        ready.set_result(f"http://127.0.0.1:{router.port}")
        await stop.wait()
        for server in [router, *servers]:
            await server.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        yield ready.result(timeout=10)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)
