"""One leg = one HTTP request to one engine. Failures become ``LegError`` with a kind the dispatcher can act
on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

import aiohttp

from pdconnector.router.backends import Backend

T = TypeVar("T")


class FailureKind(StrEnum):
    CONNECT = "connect"  # nothing reached the engine: safe to retry elsewhere
    STATUS = "status"  # the engine answered with an error status
    BROKEN = "broken"  # the connection died mid-response
    PROTOCOL = "protocol"  # the engine answered something that is not what the contract says
    REPORTED = "reported"  # the engine answered 200 with a body that reports it failed
    TIMEOUT = "timeout"
    EJECTED = "ejected"  # the router's health checks ejected the engine while the leg was in flight
    ABORTED = "aborted"  # the engine aborted the request (vLLM's finish_reason "abort", e.g. at SIGTERM)


class LegError(Exception):
    def __init__(
        self,
        backend: Backend,
        kind: FailureKind,
        detail: str,
        status: int | None = None,
        body: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{backend.name}: {kind.value}: {detail}")
        self.backend = backend
        self.kind = kind
        self.detail = detail
        self.status = status
        self.body = body


def _error_detail(status: int, raw: bytes) -> tuple[str, dict[str, Any] | None]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return f"HTTP {status}: {raw[:200].decode(errors='replace')}", None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return f"HTTP {status}: {body['error'].get('message', '')}", body
    if isinstance(body, dict) and "message" in body:
        return f"HTTP {status}: {body['message']}", body
    return f"HTTP {status}: {str(body)[:200]}", None


def _translate(backend: Backend, exc: BaseException) -> LegError:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return LegError(backend, FailureKind.CONNECT, f"cannot connect: {exc.os_error or exc}")
    if isinstance(exc, TimeoutError):
        return LegError(backend, FailureKind.TIMEOUT, "no answer in time")
    return LegError(backend, FailureKind.BROKEN, f"{type(exc).__name__}: {exc}")


async def call_json(
    session: aiohttp.ClientSession, backend: Backend, path: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[dict[str, Any], bytes]:
    """POST and read a whole JSON answer; returns the parsed body and its raw bytes (to pass through
    unchanged)."""
    try:
        async with session.post(backend.spec.base_url + path, json=body, headers=headers) as resp:
            raw = await resp.read()
            if resp.status != 200:
                detail, error_body = _error_detail(resp.status, raw)
                raise LegError(backend, FailureKind.STATUS, detail, status=resp.status, body=error_body)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise _translate(backend, exc) from exc
    try:
        parsed = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LegError(backend, FailureKind.PROTOCOL, "answer is not JSON") from exc
    if not isinstance(parsed, dict):
        raise LegError(backend, FailureKind.PROTOCOL, "answer is not a JSON object")
    return parsed, raw


def sse_data(body: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``body`` as JSON, as OpenAI's streaming API frames it."""
    return b"data: " + json.dumps(body).encode() + b"\n\n"


@dataclass
class SseEvent:
    raw: bytes
    data: dict[str, Any] | None  # None for [DONE] and for events that carry no JSON

    @property
    def is_done(self) -> bool:
        return self.raw.strip() == b"data: [DONE]"


def _parse_event(raw: bytes) -> SseEvent:
    payload = b"".join(line[5:].strip() for line in raw.splitlines() if line.startswith(b"data:"))
    if not payload or payload == b"[DONE]":
        return SseEvent(raw, None)
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return SseEvent(raw, None)
    return SseEvent(raw, data if isinstance(data, dict) else None)


class EventStream:
    """An open streaming answer from an engine, read event by event (an event ends at a blank line)."""

    def __init__(self, backend: Backend, response: aiohttp.ClientResponse) -> None:
        self.backend = backend
        self.response = response

    async def events(self) -> AsyncIterator[SseEvent]:
        buffer: list[bytes] = []
        try:
            async for line in self.response.content:
                if line.strip():
                    buffer.append(line)
                    continue
                if buffer:
                    yield _parse_event(b"".join(buffer) + b"\n")
                    buffer = []
        except (aiohttp.ClientError, OSError) as exc:
            raise _translate(self.backend, exc) from exc
        if buffer:
            yield _parse_event(b"".join(buffer) + b"\n")

    def close(self) -> None:
        # close, not release: an engine must see the connection drop to abort the request and free its blocks.
        self.response.close()


async def open_stream(
    session: aiohttp.ClientSession, backend: Backend, path: str, body: dict[str, Any], headers: dict[str, str]
) -> EventStream:
    try:
        response = await session.post(backend.spec.base_url + path, json=body, headers=headers)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise _translate(backend, exc) from exc
    if response.status != 200:
        try:
            raw = await response.read()
        except (aiohttp.ClientError, OSError) as exc:
            response.close()
            raise _translate(backend, exc) from exc
        response.close()
        detail, error_body = _error_detail(response.status, raw)
        raise LegError(backend, FailureKind.STATUS, detail, status=response.status, body=error_body)
    return EventStream(backend, response)


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel legs still running and wait until they have let go of their connections."""
    pending = [t for t in tasks if t is not None and not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


async def until_ejected(backend: Backend, leg: Awaitable[T]) -> T:
    """Run ``leg`` against ``backend``; when the health checks eject the backend first, end the leg at once
    (its connection closes, so the engine, if it still listens, aborts the request) and raise ``EJECTED``."""
    leg_task = asyncio.ensure_future(leg)
    ejected = asyncio.ensure_future(backend.ejected.wait())
    try:
        await asyncio.wait((leg_task, ejected), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when the request itself is cancelled: neither may outlive it
        ejected.cancel()
        await cancel_and_wait(leg_task)
    if leg_task.cancelled():
        raise LegError(
            backend, FailureKind.EJECTED, f"ejected while the leg was in flight: {backend.last_error}"
        )
    return leg_task.result()
