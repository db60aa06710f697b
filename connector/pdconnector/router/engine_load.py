"""Decode engines' load as they report it on ``/metrics``: KV cache usage and sequences running or waiting,
which count every router's requests (the router's own outstanding count sees only its own)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pdconnector.router.backends import Backend

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 1.0
KV_USAGE = "vllm:kv_cache_usage_perc"
SEQUENCES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def parse_load(text: str) -> tuple[float | None, int | None]:
    """``(KV cache usage 0..1, running + waiting sequences)`` from an exposition; None where absent."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (KV_USAGE, *SEQUENCES):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    usage = totals.get(KV_USAGE)
    sequences = [totals[name] for name in SEQUENCES if name in totals]
    return (
        None if usage is None else min(max(usage, 0.0), 1.0),
        int(sum(sequences)) if sequences else None,
    )


async def scrape_load(session: aiohttp.ClientSession, backend: Backend) -> None:
    """Refresh ``backend``'s reported load; a failed scrape forgets it (the router's own count remains)."""
    try:
        async with session.get(
            backend.spec.base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        ) as resp:
            text = await resp.text() if resp.status == 200 else ""
        backend.kv_usage, backend.engine_sequences = parse_load(text)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as error:
        log.debug("load scrape failed", extra={"backend": backend.name, "error": str(error)})
        backend.kv_usage, backend.engine_sequences = None, None


async def scrape_all(session: aiohttp.ClientSession, backends: list[Backend]) -> None:
    await asyncio.gather(*(scrape_load(session, backend) for backend in backends))
