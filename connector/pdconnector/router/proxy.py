"""The request path: pick a prefill and a decode engine, run both legs, relay decode's answer to the client.

Pull and push-sequential run the legs one after the other; push runs them concurrently so decode registers
its blocks while prefill computes. A request whose leg failed for a reason of the engine's (unreachable,
broken off, timed out, ejected by the health checks, aborted, its KV transfer failed) is tried again on
another pair, with a new transfer id, as long as nothing reached its client and its retry budget (attempts,
seconds) allows; what fails otherwise becomes an OpenAI-style error (or, mid-stream, an SSE error event). A
leg ends when its engine is ejected. A cancelled client request cancels both legs, which closes their
connections so the engines abort and free their blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

import aiohttp
from aiohttp import web

from pdconnector.protocol.params import (
    EngineRole,
    TransferMode,
    mint_transfer_id,
    prefill_leg_params,
    pull_decode_leg_params,
    push_decode_leg_params,
)
from pdconnector.router import errors
from pdconnector.router.backends import Backend, BackendPool
from pdconnector.router.cache_aware import PromptBlocks
from pdconnector.router.cache_state import CacheState
from pdconnector.router.failures import error_for_client, retry_for, transfer_failed
from pdconnector.router.health import eject_now
from pdconnector.router.leg_bodies import (
    aborted,
    decode_body,
    prefill_body,
    prefill_error,
    stream_error,
    stronger_evidence,
    transfer_report,
    upstream_engine_request_id,
)
from pdconnector.router.legs import (
    EventStream,
    FailureKind,
    LegError,
    SseEvent,
    call_json,
    cancel_and_wait,
    open_stream,
    sse_data,
    until_ejected,
)
from pdconnector.router.metrics import RequestOutcome, RouterMetrics
from pdconnector.router.selection import NoBackend, Selector, pick_backend
from pdconnector.router.status import Evidence, TransferLedger
from pdconnector.router.validation import ClientRequest

log = logging.getLogger(__name__)


class Dispatch(StrEnum):
    PULL = "pull"
    PUSH = "push"
    PUSH_SEQUENTIAL = "push-sequential"  # only to show in benchmarks what concurrency buys


@dataclass(frozen=True)
class DispatchSettings:
    dispatch: Dispatch = Dispatch.PUSH
    prefill_timeout_s: float = 60.0
    decode_first_byte_timeout_s: float = 120.0
    total_timeout_s: float = 600.0
    # A request is tried on at most this many prefill/decode pairs, and tried again only while this many
    # seconds have not passed since it arrived (config.Retries).
    max_attempts: int = 3
    retry_budget_s: float = 30.0
    # "vllm": the engines run upstream vLLM's NIXL connectors, whose push decode leg names the prefill
    # request.
    connector: Literal["builtin", "vllm"] = "builtin"
    # Retry-After of a 503: an ejected backend is re-admitted by the first health check it passes.
    retry_after_s: int = 2


@dataclass
class DecodeStarted:
    """Decode's answer has begun: a whole JSON body, or a stream whose first event has arrived."""

    backend: Backend
    body: dict[str, Any] | None = None
    raw: bytes = b""
    stream: EventStream | None = None
    events: AsyncIterator[SseEvent] | None = None
    first_event: SseEvent | None = None


@dataclass
class Exchange:
    """One client request in flight: chosen backends, transfer id, and everything to release at the end."""

    request_id: str
    started_at: float
    prefill: Backend | None = None
    decode: Backend | None = None
    transfer_id: str = ""
    failed: set[str] = field(default_factory=set)
    pending_prefill: asyncio.Task[Any] | None = None
    kv_holder: Backend | None = None  # the prefill whose KV this request's decode has not taken yet
    prompt: PromptBlocks | None = None  # cache-aware policy: the prompt's blocks, when it could be hashed
    queued: tuple[Backend, int] | None = None  # the prefill whose queued prompt tokens count this prompt's
    # role -> seconds to the answer (decode: to its first byte)
    legs: dict[str, float] = field(default_factory=dict)
    retries: list[dict[str, Any]] = field(default_factory=list)  # the attempts that failed and were retried
    pending_retry: tuple[LegError, str, float] | None = None  # failure, cause, seconds: retried once picked

    def headers(self) -> dict[str, str]:
        headers = {"X-Request-Id": self.request_id}
        if self.prefill is not None:
            headers["x-pd-prefill"] = self.prefill.name
        if self.decode is not None:
            headers["x-pd-decode"] = self.decode.name
        if self.transfer_id:
            headers["x-pd-transfer-id"] = self.transfer_id
        return headers


class Dispatcher:
    def __init__(
        self,
        *,
        pool: BackendPool,
        selectors: dict[EngineRole, Selector],
        session: aiohttp.ClientSession,
        settings: DispatchSettings,
        metrics: RouterMetrics,
        ledger: TransferLedger,
        cache: CacheState | None = None,
    ) -> None:
        self.cache = cache
        self.pool = pool
        self.selectors = selectors
        self.session = session
        self.settings = settings
        self.metrics = metrics
        self.ledger = ledger

    # --- selection ------------------------------------------------------------------------------------------
    def _pick(self, role: EngineRole, exchange: Exchange, partner: Backend | None = None) -> Backend:
        try:
            return pick_backend(
                self.pool, self.selectors, role, exchange.failed, partner=partner, prompt=exchange.prompt
            )
        except NoBackend as none:
            raise errors.no_backend(none.role.value, none.reasons, self.settings.retry_after_s) from None

    def _pick_prefill(self, exchange: Exchange, partner: Backend | None = None) -> Backend:
        """Choose the request's prefill; it holds the request's KV from now until decode takes it."""
        exchange.prefill = self._pick(EngineRole.PREFILL, exchange, partner)
        self._retry_started(exchange)
        self._hold_kv(exchange, exchange.prefill)
        if self.cache is not None:
            self._queue_prompt(exchange, exchange.prefill)  # before routed(): it counts what is held now
            self.cache.routed(exchange.prefill, exchange.prompt)
        return exchange.prefill

    def _queue_prompt(self, exchange: Exchange, prefill: Backend) -> None:
        """Count the prompt tokens ``prefill`` must compute (those it does not hold) against it from the
        moment it is chosen until its prefill leg ends, so that requests arriving together see each other's
        choices."""
        self._unqueue_prompt(exchange)
        if (prompt := exchange.prompt) is not None:
            exchange.queued = (prefill, prompt.tokens_to_compute(prefill))
            prefill.queued_prompt_tokens += exchange.queued[1]

    def _unqueue_prompt(self, exchange: Exchange) -> None:
        if exchange.queued is not None:
            prefill, tokens = exchange.queued
            exchange.queued = None
            prefill.queued_prompt_tokens -= tokens

    def _enter(self, backend: Backend) -> None:
        backend.outstanding += 1
        self.metrics.in_flight.labels(backend.spec.role.value, backend.name).inc()

    def _leave(self, backend: Backend) -> None:
        backend.outstanding -= 1
        self.metrics.in_flight.labels(backend.spec.role.value, backend.name).dec()

    def _hold_kv(self, exchange: Exchange, prefill: Backend) -> None:
        """Count the request against ``prefill`` until its decode leg starts (the KV arrived or was read): a
        draining prefill is removed only when none is left."""
        self._release_kv(exchange)
        exchange.kv_holder = prefill
        prefill.kv_held += 1
        self.metrics.kv_held.labels(prefill.spec.role.value, prefill.name).inc()

    def _release_kv(self, exchange: Exchange) -> None:
        if (holder := exchange.kv_holder) is not None:
            exchange.kv_holder = None
            holder.kv_held -= 1
            self.metrics.kv_held.labels(holder.spec.role.value, holder.name).dec()

    @contextlib.contextmanager
    def _occupy(self, backend: Backend) -> Iterator[None]:
        self._enter(backend)
        try:
            yield
        finally:
            self._leave(backend)

    # --- legs -----------------------------------------------------------------------------------------------
    async def _prefill_leg(
        self, backend: Backend, request: ClientRequest, params: dict[str, Any], exchange: Exchange
    ) -> dict[str, Any]:
        body = prefill_body(request.body, params)
        sent = asyncio.get_running_loop().time()
        with self._occupy(backend):
            try:
                async with asyncio.timeout(self.settings.prefill_timeout_s):
                    answer, _ = await until_ejected(
                        backend,
                        call_json(
                            self.session,
                            backend,
                            request.endpoint.value,
                            body,
                            {"X-Request-Id": exchange.request_id},
                        ),
                    )
            except TimeoutError as exc:
                raise LegError(
                    backend,
                    FailureKind.TIMEOUT,
                    f"prefill gave no answer in {self.settings.prefill_timeout_s:g} s",
                ) from exc
            finally:
                self._unqueue_prompt(exchange)
        if aborted(answer):
            raise LegError(backend, FailureKind.ABORTED, "prefill aborted the request (shutting down?)")
        if (reported := prefill_error(answer)) is not None:
            # In push mode decode would otherwise wait out its transfer deadline for KV that will never be
            # written.
            raise LegError(backend, FailureKind.REPORTED, f"it kept no KV for decode: {reported}")
        backend.served += 1
        self._leg_answered(EngineRole.PREFILL, exchange, sent)
        return answer

    def _leg_answered(self, role: EngineRole, exchange: Exchange, sent: float) -> None:
        seconds = asyncio.get_running_loop().time() - sent
        exchange.legs[role.value] = seconds
        self.metrics.legs.labels(self.settings.dispatch.value, role.value).observe(seconds)

    async def _decode_leg(
        self,
        backend: Backend,
        request: ClientRequest,
        params: dict[str, Any],
        exchange: Exchange,
        deadline: float,
    ) -> DecodeStarted:
        body = decode_body(request.body, params)
        headers = {"X-Request-Id": exchange.request_id}
        loop = asyncio.get_running_loop()
        sent = loop.time()
        if not request.stream:
            try:
                with self._occupy(backend):
                    async with asyncio.timeout_at(deadline):
                        answer, raw = await until_ejected(
                            backend, call_json(self.session, backend, request.endpoint.value, body, headers)
                        )
            except TimeoutError as exc:
                raise LegError(backend, FailureKind.TIMEOUT, "decode gave no answer in time") from exc
            if aborted(answer):
                raise LegError(backend, FailureKind.ABORTED, "decode aborted the request (shutting down?)")
            self._leg_answered(EngineRole.DECODE, exchange, sent)
            return DecodeStarted(backend=backend, body=answer, raw=raw)
        first_byte_deadline = min(deadline, loop.time() + self.settings.decode_first_byte_timeout_s)
        stream: EventStream | None = None
        events: AsyncIterator[SseEvent] | None = None

        async def first_event() -> SseEvent | None:
            nonlocal stream, events
            stream = await open_stream(self.session, backend, request.endpoint.value, body, headers)
            events = aiter(stream.events())
            return await anext(events, None)

        self._enter(backend)
        try:
            async with asyncio.timeout_at(first_byte_deadline):
                first = await until_ejected(backend, first_event())
            if first is None:
                raise LegError(backend, FailureKind.BROKEN, "decode closed the stream before the first event")
            if aborted(first.data):
                raise LegError(backend, FailureKind.ABORTED, "decode aborted the request (shutting down?)")
            if (error := stream_error(first.data)) is not None:
                # vLLM streams a failure as an error event after its 200 (e.g. a failed KV transfer): nothing
                # reached the client yet, so it is a failed leg like an error status.
                code = error.get("code")
                raise LegError(
                    backend,
                    FailureKind.STATUS,
                    f"HTTP {code}: {error.get('message', '')}",
                    status=code if isinstance(code, int) else 500,
                    body={"error": error},
                )
        except BaseException as exc:
            if stream is not None:
                stream.close()
            self._leave(backend)
            if isinstance(exc, TimeoutError):
                raise LegError(backend, FailureKind.TIMEOUT, "decode sent no first token in time") from exc
            raise
        self._leg_answered(EngineRole.DECODE, exchange, sent)
        assert events is not None
        return DecodeStarted(backend=backend, stream=stream, events=events, first_event=first)

    def _finish_stream(self, started: DecodeStarted) -> None:
        """Close decode's stream and stop counting it against its backend (once per started stream)."""
        if started.stream is not None:
            started.stream.close()
            started.stream = None
            self._leave(started.backend)

    def _discard(self, task: asyncio.Task[DecodeStarted]) -> None:
        """A decode leg finished but its answer will not be used: let go of its stream."""
        if task.done() and not task.cancelled() and task.exception() is None:
            self._finish_stream(task.result())

    # --- orchestration --------------------------------------------------------------------------------------
    def _note_failure(self, error: LegError) -> None:
        self.metrics.leg_errors.labels(error.backend.spec.role.value, error.kind.value).inc()
        if error.kind is FailureKind.CONNECT:
            eject_now(error.backend, error.detail)

    async def _attempts(self, request: ClientRequest, exchange: Exchange, deadline: float) -> DecodeStarted:
        """Run the request on one pair after another until one starts answering, a failure is the request's
        own, or the retry budget is spent; the last failure is what the client hears."""
        attempt = self._concurrent if self.settings.dispatch is Dispatch.PUSH else self._sequential
        loop = asyncio.get_running_loop()
        failed: LegError | None = None
        for number in range(1, self.settings.max_attempts + 1):
            tried_at = loop.time()
            try:
                started = await attempt(request, exchange, deadline)
            except errors.RouterError as refusal:
                # No pair left to try (the selection's 503). Where the engines that failed were ejected, the
                # refusal names them all; otherwise the failure that sent us here is the answer.
                if (
                    refusal.status == 503
                    and failed is not None
                    and failed.kind not in (FailureKind.CONNECT, FailureKind.EJECTED)
                ):
                    raise failed from None
                raise
            except LegError as error:
                failed = error
                self._note_failure(error)
                retry = retry_for(error, exchange.prefill)
                now = loop.time()
                if (
                    retry is None
                    or number == self.settings.max_attempts
                    or now - exchange.started_at > self.settings.retry_budget_s
                    or now >= deadline
                ):
                    raise
                exchange.pending_retry = (error, retry.cause, now - tried_at)
                exchange.failed.update(backend.name for backend in retry.avoid)
                continue
            if self.cache is not None:
                self.cache.decoding(started.backend, exchange.prompt)
            return started
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _retry_started(self, exchange: Exchange) -> None:
        """A failed attempt's successor has its engines: count the retry (one that found no pair is none)."""
        if exchange.pending_retry is None:
            return
        error, cause, seconds = exchange.pending_retry
        exchange.pending_retry = None
        role = error.backend.spec.role.value
        self.metrics.retries.labels(role, cause).inc()
        self.metrics.retry_seconds.labels(cause).inc(seconds)
        exchange.retries.append(
            {"role": role, "backend": error.backend.name, "cause": cause, "ms": round(seconds * 1e3, 3)}
        )
        log.warning(
            "retrying on another pair",
            extra={
                "request_id": exchange.request_id,
                "backend": error.backend.name,
                "role": role,
                "cause": cause,
                "failed_transfer_id": exchange.transfer_id,
                "error": error.detail,
            },
        )

    async def _sequential(self, request: ClientRequest, exchange: Exchange, deadline: float) -> DecodeStarted:
        """One attempt, the legs one after the other."""
        push = self.settings.dispatch is Dispatch.PUSH_SEQUENTIAL
        mode = TransferMode.PUSH if push else TransferMode.PULL
        exchange.decode = self._pick(EngineRole.DECODE, exchange) if push else None
        prefill = self._pick_prefill(exchange, partner=exchange.decode)
        exchange.transfer_id = mint_transfer_id()
        answer = await self._prefill_leg(
            prefill, request, prefill_leg_params(mode, exchange.transfer_id), exchange
        )
        if push:
            decode_params = push_decode_leg_params(exchange.transfer_id, prefill.spec.prefill_coordinates())
        else:
            returned = answer.get("kv_transfer_params")
            if not isinstance(returned, dict):
                self.metrics.transfer_failures.inc()
                raise errors.transfer_failed(
                    f"prefill engine {prefill.name} returned no kv_transfer_params (is its KV "
                    "connector configured?)"
                )
            decode_params = pull_decode_leg_params(returned, exchange.transfer_id)
            exchange.decode = self._pick(EngineRole.DECODE, exchange, partner=prefill)
        started = await self._decode_leg(exchange.decode, request, decode_params, exchange, deadline)
        self._release_kv(exchange)
        return started

    async def _concurrent(self, request: ClientRequest, exchange: Exchange, deadline: float) -> DecodeStarted:
        """One attempt, both legs at once."""
        exchange.decode = self._pick(EngineRole.DECODE, exchange)
        chosen = self._pick_prefill(exchange, partner=exchange.decode)
        exchange.transfer_id = mint_transfer_id()
        decode_params = push_decode_leg_params(exchange.transfer_id, chosen.spec.prefill_coordinates())
        if self.settings.connector == "vllm":
            decode_params["remote_request_id"] = upstream_engine_request_id(
                request.endpoint, exchange.request_id
            )
        prefill = asyncio.create_task(
            self._prefill_leg(
                chosen, request, prefill_leg_params(TransferMode.PUSH, exchange.transfer_id), exchange
            )
        )
        decode = asyncio.create_task(
            self._decode_leg(exchange.decode, request, decode_params, exchange, deadline)
        )
        try:
            started = await self._first_decode_answer(prefill, decode)
        except BaseException:
            # If one leg fails the other is aborted: decode would wait for KV in vain, prefill would hold
            # blocks.
            await cancel_and_wait(prefill, decode)
            self._discard(decode)
            raise
        exchange.pending_prefill = None if prefill.done() else prefill
        self._release_kv(exchange)
        return started

    async def _first_decode_answer(
        self, prefill: asyncio.Task[Any], decode: asyncio.Task[DecodeStarted]
    ) -> DecodeStarted:
        """Wait for decode to start answering; a prefill failure in the meantime ends the request (decode
        would wait for KV in vain)."""
        pending: set[asyncio.Task[Any]] = {prefill, decode}
        while decode in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if prefill in done and prefill.exception() is not None:
                raise prefill.exception()  # type: ignore[misc]
        return decode.result()

    # --- the client-facing part -----------------------------------------------------------------------------
    async def serve(
        self, http_request: web.Request, request: ClientRequest, request_id: str
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        exchange = Exchange(request_id=request_id, started_at=loop.time())
        deadline = exchange.started_at + self.settings.total_timeout_s
        dispatch = self.settings.dispatch.value
        outcome = RequestOutcome.CANCELLED
        started: DecodeStarted | None = None
        try:
            try:
                if self.cache is not None:
                    exchange.prompt = await self.cache.prompt_blocks(self.session, self.pool, request)
                started = await self._attempts(request, exchange, deadline)
            except LegError as error:
                router_error = self._classify(error, exchange)
                outcome = (
                    RequestOutcome.CLIENT_ERROR
                    if router_error.status < 500
                    else RequestOutcome.UPSTREAM_ERROR
                )
                return self._error_response(router_error, exchange)
            except errors.RouterError as router_error:
                outcome = (
                    RequestOutcome.UNAVAILABLE
                    if router_error.status == 503
                    else RequestOutcome.UPSTREAM_ERROR
                )
                return self._error_response(router_error, exchange)
            if started.stream is None:
                response, outcome = self._reply_whole(started, exchange)
            else:
                response, outcome = await self._relay_stream(http_request, started, exchange, deadline)
            started.backend.served += 1
            return response
        finally:
            self._release_kv(exchange)
            if started is not None:
                self._finish_stream(started)
            await cancel_and_wait(exchange.pending_prefill)
            self._unqueue_prompt(exchange)  # chosen, but its prefill leg never started
            self.metrics.requests.labels(dispatch, outcome).inc()
            self.metrics.latency.labels(dispatch).observe(loop.time() - exchange.started_at)
            log.info(
                "request finished",
                extra={
                    "request_id": request_id,
                    "outcome": outcome,
                    "prefill": exchange.prefill.name if exchange.prefill else None,
                    "decode": exchange.decode.name if exchange.decode else None,
                    "transfer_id": exchange.transfer_id,
                    "seconds": round(loop.time() - exchange.started_at, 4),
                    "legs_ms": {role: round(seconds * 1e3, 3) for role, seconds in exchange.legs.items()},
                    "retries": exchange.retries,
                },
            )

    def _error_response(self, error: errors.RouterError, exchange: Exchange) -> web.Response:
        response = error.response()
        response.headers.update(exchange.headers())
        return response

    def _classify(self, error: LegError, exchange: Exchange) -> errors.RouterError:
        if transfer_failed(error):
            self.metrics.transfer_failures.inc()
        return error_for_client(error, exchange.transfer_id)

    def _record_transfer(self, report: Evidence | None) -> None:
        # Upstream vLLM connectors never report how KV arrived: their answers prove nothing either way.
        evidence = Evidence.UNCONFIRMABLE if report is None or self.settings.connector == "vllm" else report
        self.ledger.record(evidence)
        self.metrics.transfers.labels(evidence.value).inc()

    def _reply_whole(self, started: DecodeStarted, exchange: Exchange) -> tuple[web.Response, RequestOutcome]:
        self._record_transfer(transfer_report(started.body))
        response = web.Response(body=started.raw, content_type="application/json", headers=exchange.headers())
        return response, RequestOutcome.OK

    async def _relay_stream(
        self, http_request: web.Request, started: DecodeStarted, exchange: Exchange, deadline: float
    ) -> tuple[web.StreamResponse, RequestOutcome]:
        assert started.first_event is not None and started.events is not None
        loop = asyncio.get_running_loop()
        response = web.StreamResponse(
            status=200,
            headers={**exchange.headers(), "Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
        )
        await response.prepare(http_request)
        report: Evidence | None = None
        finished = False
        error_seen = False

        async def forward(event: SseEvent) -> None:
            nonlocal report, finished, error_seen
            report = stronger_evidence(report, transfer_report(event.data))
            error_seen = error_seen or stream_error(event.data) is not None
            if event.is_done and not finished and not error_seen:
                # Count the request before the client sees [DONE]: /status must never lag what a client was
                # told.
                self._record_transfer(report)
            finished = finished or event.is_done
            await response.write(event.raw + b"\n" if not event.raw.endswith(b"\n\n") else event.raw)

        await forward(started.first_event)
        self.metrics.ttft.labels(self.settings.dispatch.value).observe(loop.time() - exchange.started_at)
        failure: errors.RouterError | None = None

        async def forward_rest() -> None:
            assert started.events is not None
            async for event in started.events:
                await forward(event)

        try:
            async with asyncio.timeout_at(deadline):
                await until_ejected(started.backend, forward_rest())
        except TimeoutError:
            failure = errors.timed_out("the decode stream to finish", self.settings.total_timeout_s)
        except LegError as error:
            self._note_failure(error)
            failure = self._classify(error, exchange)
        if failure is None and not finished and not error_seen:
            failure = errors.upstream_failed(
                "decode", started.backend.describe(), exchange.transfer_id, "the stream ended without [DONE]"
            )
        if failure is not None:
            await response.write(sse_data(failure.body()))
        await response.write_eof()
        if failure is not None or error_seen:
            return response, RequestOutcome.UPSTREAM_ERROR
        return response, RequestOutcome.OK
