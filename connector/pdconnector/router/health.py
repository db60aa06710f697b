"""Active health checks: GET /health on every backend; eject after repeated failures, re-admit on success."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp

from pdconnector.router.backends import Backend, BackendPool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthSettings:
    interval_s: float = 2.0
    timeout_s: float = 1.0
    failures_to_eject: int = 2


def record_failure(backend: Backend, error: str, failures_to_eject: int) -> None:
    backend.consecutive_failures += 1
    backend.last_error = error
    if backend.healthy and backend.consecutive_failures >= failures_to_eject:
        backend.eject(error)
        log.warning(
            "backend ejected",
            extra={"backend": backend.name, "role": backend.spec.role.value, "error": error},
        )


def record_success(backend: Backend) -> None:
    if not backend.healthy:
        log.info("backend re-admitted", extra={"backend": backend.name, "role": backend.spec.role.value})
        backend.readmit()
    backend.consecutive_failures = 0
    backend.last_error = None


def eject_now(backend: Backend, error: str) -> None:
    """A request could not even connect: stop sending traffic until a probe succeeds."""
    record_failure(backend, error, failures_to_eject=1)


async def _advertised_compat(resp: aiohttp.ClientResponse) -> str | None:
    """Engines may answer /health with JSON naming their compatibility hash (vLLM answers an empty body)."""
    if resp.content_type != "application/json":
        return None
    try:
        body = await resp.json()
    except (aiohttp.ContentTypeError, ValueError):
        return None
    compat = body.get("compat_hash") if isinstance(body, dict) else None
    return compat if isinstance(compat, str) and compat else None


async def probe(session: aiohttp.ClientSession, backend: Backend, settings: HealthSettings) -> None:
    try:
        async with session.get(
            backend.spec.base_url + "/health", timeout=aiohttp.ClientTimeout(total=settings.timeout_s)
        ) as resp:
            if resp.status == 200:
                backend.advertised_compat = await _advertised_compat(resp)
                record_success(backend)
            else:
                record_failure(backend, f"/health answered {resp.status}", settings.failures_to_eject)
    except TimeoutError:  # before ClientError: aiohttp's timeouts are both
        record_failure(
            backend, f"/health gave no answer in {settings.timeout_s:g} s", settings.failures_to_eject
        )
    except aiohttp.ClientConnectorError as exc:
        record_failure(backend, f"/health: cannot connect: {exc.os_error or exc}", settings.failures_to_eject)
    except (aiohttp.ClientError, OSError) as exc:
        record_failure(backend, f"/health failed: {type(exc).__name__}: {exc}", settings.failures_to_eject)


async def probe_all(session: aiohttp.ClientSession, pool: BackendPool, settings: HealthSettings) -> None:
    await asyncio.gather(*(probe(session, backend, settings) for backend in pool.all()))
