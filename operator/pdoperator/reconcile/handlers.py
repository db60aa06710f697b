"""The kopf handlers: thin adapters from kopf's causes to ``Reconciler``. Each handler, its cause, its work:

- ``configure``, at startup: kopf settings (storage keys, timeouts, events).
- ``login``, at login: credentials from the kubernetes client's config.
- ``reconcile_pdservice``, on PDService create / update / resume: children to the spec, status; PermanentError
  on an invalid spec.
- ``delete_pdservice``, on PDService delete (finalizer): deletes the children it controls.
- ``child_changed``, on events of labelled StatefulSets, Deployments, Services and ConfigMaps: reconciles the
  owner (drift, status).
- ``verify_kv_transfer``, a timer per PDService: reads the router's ``/status`` -> KVTransferVerified.
- ``autoscale``, a timer per PDService: with spec.autoscaling builtin, reads the router's and the engines'
  ``/metrics``, plans, and reconciles the roles to a new scale.
- ``close_session``, at cleanup: closes the HTTP session of the router probes.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from pdoperator.api.model import GROUP, KIND, PLURAL, VERSION, PDService
from pdoperator.autoscale.rounds import Readings
from pdoperator.autoscale.scale import Scale
from pdoperator.render.names import LABEL_NAME, PRODUCT

from . import metrics
from .kinds import WATCHED_CHILD_KINDS
from .kube import KubeApiError
from .kvtransfer import RouterUrlResolver, TransferCounts, fetch_router_status
from .metrics_source import MetricsUrls, read_metrics
from .reconciler import InvalidSpecError, Reconciler

FINALIZER = f"{GROUP}/finalizer"


@dataclass(frozen=True)
class HandlerSettings:
    kv_check_interval_seconds: float = 15.0
    router_status_timeout_seconds: float = 3.0
    api_request_timeout_seconds: float = 30.0
    # An integer: kopf sends it as the watch's timeoutSeconds, which the API server parses as one (300.0 is a
    # 400 Bad Request).
    watch_server_timeout_seconds: int = 300
    retry_delay_seconds: float = 5.0
    autoscale_interval_seconds: float = 15.0
    metrics_timeout_seconds: float = 3.0


def plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """kopf's body view as a private plain dict (the reconciler may keep parts of it)."""
    return copy.deepcopy(dict(body))


def record_event(body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    kopf.event(body, type=type_, reason=reason, message=message[:1024])


def controller_owner(body: Mapping[str, Any]) -> str | None:
    """Name of the PDService controlling a child, if any."""
    for ref in body.get("metadata", {}).get("ownerReferences") or []:
        if (
            ref.get("controller")
            and ref.get("kind") == KIND
            and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/")
        ):
            return str(ref["name"])
    return None


def apply_kopf_settings(settings: kopf.OperatorSettings, options: HandlerSettings) -> None:
    # kopf's bookkeeping under our own API group; annotations only, so .status stays ours.
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.reporting_component = PRODUCT
    settings.posting.event_name_prefix = f"{PRODUCT}-"
    settings.networking.request_timeout = options.api_request_timeout_seconds
    settings.networking.connect_timeout = 10
    # Long watches, re-established promptly when the server or a proxy drops them.
    settings.watching.server_timeout = options.watch_server_timeout_seconds
    settings.watching.client_timeout = options.watch_server_timeout_seconds + 30
    settings.watching.reconnect_backoff = 1.0


def register(
    registry: kopf.OperatorRegistry,
    reconciler: Reconciler,
    resolve_router_url: RouterUrlResolver,
    metrics_urls: MetricsUrls,
    options: HandlerSettings,
) -> None:
    sessions: list[aiohttp.ClientSession] = []

    @kopf.on.startup(id="configure", registry=registry)
    async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        apply_kopf_settings(settings, options)
        sessions.append(aiohttp.ClientSession())

    @kopf.on.login(id="login", registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # The same credentials as the reconciler's client: service account in a pod, else kubeconfig.
        return kopf.login_via_client(**kwargs)

    @kopf.on.cleanup(id="close-session", registry=registry)
    async def close_session(**_: Any) -> None:
        for session in sessions:
            await session.close()

    @kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    async def reconcile_pdservice(body: kopf.Body, reason: str, **_: Any) -> None:
        started = time.monotonic()
        try:
            outcome = await reconciler.reconcile(plain(body))
        except InvalidSpecError as e:
            metrics.RECONCILES.labels(trigger=reason, result="invalid").inc()
            raise kopf.PermanentError(f"invalid spec: {e}") from e
        except KubeApiError as e:
            metrics.RECONCILES.labels(trigger=reason, result="error").inc()
            raise kopf.TemporaryError(str(e), delay=options.retry_delay_seconds) from e
        metrics.observe(reason, outcome, time.monotonic() - started)

    @kopf.on.delete(GROUP, VERSION, PLURAL, id="delete-children", registry=registry)
    async def delete_pdservice(body: kopf.Body, **_: Any) -> None:
        try:
            await reconciler.delete_children(plain(body))
        except KubeApiError as e:
            raise kopf.TemporaryError(str(e), delay=options.retry_delay_seconds) from e

    async def child_changed(
        body: kopf.Body, type: str | None, namespace: str | None, resource: kopf.Resource, **_: Any
    ) -> None:
        owner = controller_owner(body)
        if owner is None or namespace is None or type is None:
            # not ours, or the initial listing (resume handlers cover what happened while the operator was
            # away)
            return
        meta = body.get("metadata", {})
        if type != "DELETED" and reconciler.is_own_write(
            resource.plural, namespace, meta.get("name", ""), meta.get("resourceVersion")
        ):
            return
        started = time.monotonic()
        try:
            outcome = await reconciler.request(namespace, owner)
        except KubeApiError as e:
            metrics.RECONCILES.labels(trigger="child", result="error").inc()
            kopf.warn(body, reason="ReconcileFailed", message=str(e))  # the next event of any child retries
            return
        if outcome is not None:
            metrics.observe("child", outcome, time.monotonic() - started)

    for kind in WATCHED_CHILD_KINDS:
        watch = kopf.on.event(
            kind.group,
            kind.version,
            kind.plural,
            labels={LABEL_NAME: PRODUCT},
            id=f"child-{kind.plural}",
            registry=registry,
        )
        watch(child_changed)

    _register_probes(
        registry, reconciler, sessions, resolve_router_url, metrics_urls=metrics_urls, options=options
    )


def _register_probes(
    registry: kopf.OperatorRegistry,
    reconciler: Reconciler,
    sessions: list[aiohttp.ClientSession],
    resolve_router_url: RouterUrlResolver,
    *,
    metrics_urls: MetricsUrls,
    options: HandlerSettings,
) -> None:
    """The timers that read the router and the engines: KV transfer verification and the autoscaler."""

    async def fetch(pds: PDService) -> TransferCounts:
        return await fetch_router_status(
            sessions[0], resolve_router_url(pds), options.router_status_timeout_seconds
        )

    @kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        id="kv-transfer",
        interval=options.kv_check_interval_seconds,
        registry=registry,
    )
    async def verify_kv_transfer(body: kopf.Body, **_: Any) -> None:
        try:
            await reconciler.probe_kv_transfer(plain(body), fetch)
        except KubeApiError as e:
            kopf.warn(body, reason="KVTransferCheckFailed", message=str(e))

    async def read(pds: PDService, scale: Scale) -> Readings:
        return await read_metrics(sessions[0], metrics_urls, pds, scale, options.metrics_timeout_seconds)

    @kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        id="autoscale",
        interval=options.autoscale_interval_seconds,
        registry=registry,
    )
    async def autoscale(body: kopf.Body, **_: Any) -> None:
        try:
            await reconciler.autoscale(plain(body), read)
        except KubeApiError as e:
            kopf.warn(body, reason="AutoscaleFailed", message=str(e))
