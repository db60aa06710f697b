"""The router's aiohttp application: OpenAI endpoints, probes, metrics and status, plus its background
loops."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from pdconnector.protocol.params import EngineRole
from pdconnector.router import errors
from pdconnector.router.backends import BackendPool
from pdconnector.router.cache_state import CacheState, weights_of
from pdconnector.router.config import RouterConfig
from pdconnector.router.discovery import AddressBook, ConfigWatcher, backend_specs
from pdconnector.router.engine_load import scrape_all
from pdconnector.router.health import HealthSettings, probe_all
from pdconnector.router.metrics import RouterMetrics
from pdconnector.router.proxy import Dispatch, Dispatcher, DispatchSettings
from pdconnector.router.selection import Policy, Selector
from pdconnector.router.status import TransferLedger, build_status
from pdconnector.router.validation import Endpoint, parse_body, validate_request

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
REQUEST_ID_KEY = web.RequestKey("request_id", str)
_POLICIES = {
    "least-loaded": Policy.LEAST_OUTSTANDING,
    "round-robin": Policy.ROUND_ROBIN,
    "cache-aware": Policy.CACHE_AWARE,
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class RouterOptions:
    """Process-level settings that are not part of the PDService's config file."""

    config_path: Path | None = None
    dispatch: Dispatch | None = None  # None: follow the config's mode; push-sequential exists for benchmarks
    total_timeout_s: float = 600.0
    refresh_interval_s: float = 2.0
    health: HealthSettings = field(default_factory=HealthSettings)
    api_key: str | None = None


def selectors_for(config: RouterConfig) -> dict[EngineRole, Selector]:
    weights = weights_of(config.cache_aware) if config.cache_aware is not None else None
    return {role: Selector(_POLICIES[config.policy], role, weights) for role in EngineRole}


def dispatch_settings(config: RouterConfig, options: RouterOptions) -> DispatchSettings:
    return DispatchSettings(
        dispatch=options.dispatch or Dispatch(config.mode),
        prefill_timeout_s=config.timeouts.prefill_s,
        decode_first_byte_timeout_s=config.timeouts.prefill_s
        + config.timeouts.transfer_s
        + config.timeouts.decode_first_token_s,
        total_timeout_s=options.total_timeout_s,
        max_attempts=config.retries.attempts,
        retry_budget_s=config.retries.budget_s,
        connector=config.connector,
        retry_after_s=max(1, math.ceil(options.health.interval_s)),
    )


class Router:
    """The live state of one router: config, backends, dispatcher, counters."""

    def __init__(self, config: RouterConfig, options: RouterOptions) -> None:
        self.config = config
        self.options = options
        self.pool = BackendPool()
        self.addresses = AddressBook()
        self.metrics = RouterMetrics()
        self.ledger = TransferLedger()
        self.session: aiohttp.ClientSession | None = None
        self.dispatcher: Dispatcher | None = None
        self.cache: CacheState | None = None
        self.pool.replace(backend_specs(config, {}))
        self.metrics.show_pool(self.pool.all())

    def _replace_backends(self) -> None:
        self.pool.replace(backend_specs(self.config, self.addresses.addresses))
        if self.cache is not None:
            self.cache.track(self.pool)

    async def use_cache_policy(self, config: RouterConfig) -> None:
        """Start or stop the cache-aware policy's state to match ``config``; changed hashing starts over."""
        wanted = config.cache_aware if config.policy == "cache-aware" else None
        if self.cache is not None and self.cache.config != wanted:
            await self.cache.close()
            self.cache = None
            for backend in self.pool.all():
                backend.prefix_index = backend.tier_index = None
        if wanted is not None and self.cache is None:
            self.cache = CacheState(wanted, self.metrics)
            self.cache.track(self.pool)
        if self.dispatcher is not None:
            self.dispatcher.cache = self.cache

    def apply_config(self, config: RouterConfig) -> None:
        self.config = config
        self._replace_backends()
        self.metrics.show_pool(self.pool.all())
        if self.dispatcher is not None:
            self.dispatcher.settings = dispatch_settings(config, self.options)
            fresh = selectors_for(config)
            if any(
                (fresh[role].policy, fresh[role].weights) != (selector.policy, selector.weights)
                for role, selector in self.dispatcher.selectors.items()
            ):
                self.dispatcher.selectors = fresh  # round-robin's cursor survives other config changes
        log.info(
            "router config applied",
            extra={
                "prefill": len(config.prefill.backends),
                "decode": len(config.decode.backends),
                "draining": [b.name for b in self.pool.all() if b.spec.draining],
                "mode": config.mode,
            },
        )

    async def refresh(self, watcher: ConfigWatcher | None) -> None:
        if watcher is not None:
            watcher.check()
        await self.use_cache_policy(self.config)
        await self.addresses.refresh(self.config)
        self._replace_backends()

    async def background(self) -> None:
        watcher = (
            ConfigWatcher(self.options.config_path, self.apply_config) if self.options.config_path else None
        )
        if watcher is not None:
            watcher.check()  # records the current stamp so only later edits count as changes
        assert self.session is not None
        next_refresh = 0.0
        loop = asyncio.get_running_loop()
        while True:
            if loop.time() >= next_refresh:
                await self.refresh(watcher)
                next_refresh = loop.time() + self.options.refresh_interval_s
            await probe_all(self.session, self.pool, self.options.health)
            if self.cache is not None:
                await scrape_all(self.session, self.pool.serving(EngineRole.DECODE))
            await asyncio.sleep(min(self.options.health.interval_s, self.options.refresh_interval_s))


ROUTER_KEY = web.AppKey("router", Router)


def _openai_error_middleware(
    router: Router,
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        incoming = request.headers.get(REQUEST_ID_HEADER, "")
        request_id = incoming if _REQUEST_ID_PATTERN.match(incoming) else uuid.uuid4().hex
        request[REQUEST_ID_KEY] = request_id
        try:
            if request.path.startswith("/v1/") and router.options.api_key is not None:
                _check_api_key(request, router.options.api_key)
            response = await handler(request)
        except errors.RouterError as error:
            response = error.response()
        except web.HTTPException as http_error:
            if http_error.status < 400:
                raise
            response = errors.RouterError(
                http_error.status,
                http_error.reason,
                "invalid_request_error",
                "http_" + str(http_error.status),
            ).response()
        if not response.prepared:
            response.headers[REQUEST_ID_HEADER] = request_id
        return response

    return middleware


def _check_api_key(request: web.Request, api_key: str) -> None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise errors.unauthorized()


def create_app(config: RouterConfig, options: RouterOptions | None = None) -> web.Application:
    options = options or RouterOptions()
    router = Router(config, options)
    app = web.Application(
        middlewares=[_openai_error_middleware(router)], client_max_size=config.max_request_body_bytes
    )
    app[ROUTER_KEY] = router

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=router.config.timeouts.connect_s)
        router.session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0, force_close=False)
        )
        router.dispatcher = Dispatcher(
            pool=router.pool,
            selectors=selectors_for(config),
            session=router.session,
            settings=dispatch_settings(config, options),
            metrics=router.metrics,
            ledger=router.ledger,
        )
        await router.use_cache_policy(router.config)
        task = asyncio.create_task(router.background())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if router.cache is not None:
            await router.cache.close()
        await router.session.close()

    app.cleanup_ctx.append(lifecycle)

    def completion_handler(endpoint: Endpoint) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise errors.body_too_large(router.config.max_request_body_bytes) from None
            config = router.config
            client_request = validate_request(
                endpoint, parse_body(raw), config.served_model_name, max_model_len=config.max_model_len
            )
            assert router.dispatcher is not None
            return await router.dispatcher.serve(request, client_request, request[REQUEST_ID_KEY])

        return handle

    async def models(_: web.Request) -> web.Response:
        model = {
            "id": router.config.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pd-operator",
        }
        return web.json_response({"object": "list", "data": [model]})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(_: web.Request) -> web.Response:
        ok = router.pool.is_ready()
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=router.metrics.exposition(), content_type="text/plain", charset="utf-8")

    async def status(_: web.Request) -> web.Response:
        mode = (options.dispatch or Dispatch(router.config.mode)).value
        return web.json_response(
            build_status(
                router.pool, router.ledger, mode, router.config.served_model_name, router.config.policy
            )
        )

    app.router.add_post(Endpoint.COMPLETIONS.value, completion_handler(Endpoint.COMPLETIONS))
    app.router.add_post(Endpoint.CHAT.value, completion_handler(Endpoint.CHAT))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status)
    return app
