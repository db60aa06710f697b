"""Where the autoscaler reads: the router's and each engine's ``/metrics`` over HTTP, the I/O edge of
``pdoperator.autoscale`` (which only sees the texts)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from pdconnector.protocol.params import EngineRole

from pdoperator.api.model import PDService
from pdoperator.autoscale.rounds import Readings
from pdoperator.autoscale.scale import Scale
from pdoperator.render.names import ComponentRole, pod_dns_name, pod_name


@dataclass(frozen=True)
class MetricsUrls:
    router: Callable[[PDService], str]
    engine: Callable[[PDService, ComponentRole, int], str]


def service_dns_metrics_urls(cluster_domain: str) -> MetricsUrls:
    """In the cluster: the router Service, and each engine pod by its stable DNS name."""
    return MetricsUrls(
        router=lambda pds: (
            f"http://{pds.name}-router.{pds.namespace}.svc.{cluster_domain}:{pds.spec.router.port}/metrics"
        ),
        engine=lambda pds, role, ordinal: (
            f"http://{pod_dns_name(pds, role, ordinal, cluster_domain)}:{pds.spec.engine.port}/metrics"
        ),
    )


def template_metrics_urls(router_template: str, engine_template: str) -> MetricsUrls:
    """URLs from templates (port-forwards, tests): ``{name}``, ``{namespace}`` in both; ``{port}`` the
    router's port or the engines'; ``{role}``, ``{ordinal}`` and ``{pod}`` in the engines'."""
    return MetricsUrls(
        router=lambda pds: router_template.format(
            name=pds.name, namespace=pds.namespace, port=pds.spec.router.port
        ),
        engine=lambda pds, role, ordinal: engine_template.format(
            name=pds.name,
            namespace=pds.namespace,
            port=pds.spec.engine.port,
            role=role.value,
            ordinal=ordinal,
            pod=pod_name(pds, role, ordinal),
        ),
    )


async def fetch_text(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str | None:
    """The body of ``GET url``; None when it fails or does not answer 200 in time."""
    try:
        async with asyncio.timeout(timeout_s), session.get(url) as response:
            if response.status != 200:
                return None
            return await response.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError, ValueError):
        return None


async def read_metrics(
    session: aiohttp.ClientSession, urls: MetricsUrls, pds: PDService, scale: Scale, timeout_s: float
) -> Readings:
    """One round: the router and every engine the roles run (draining ones too), concurrently."""
    engines = [
        (ComponentRole(role.value), ordinal)
        for role in EngineRole
        for ordinal in range(scale.of(role).replicas)
    ]
    texts = await asyncio.gather(
        fetch_text(session, urls.router(pds), timeout_s),
        *(fetch_text(session, urls.engine(pds, role, ordinal), timeout_s) for role, ordinal in engines),
    )
    return Readings(
        at=time.monotonic(),
        router=texts[0],
        engines={
            pod_name(pds, role, ordinal): text
            for (role, ordinal), text in zip(engines, texts[1:], strict=True)
        },
    )
