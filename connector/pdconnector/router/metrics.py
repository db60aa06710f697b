"""Prometheus metrics of one router (own registry, so several routers can live in one process for tests)."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdconnector.router.backends import Backend

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


class RequestOutcome(StrEnum):
    """How a client request ended: the ``outcome`` label of ``pd_router_requests`` and the request log."""

    OK = "ok"
    CANCELLED = "cancelled"  # the client left first
    CLIENT_ERROR = "client_error"  # a 4xx: the request was bad
    UPSTREAM_ERROR = "upstream_error"  # an engine or the KV transfer failed
    UNAVAILABLE = "unavailable"  # a 503: no healthy backend


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pd_router_requests",
            "Client requests by transfer mode and outcome",
            ["mode", "outcome"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "pd_router_ttft_seconds",
            "Time to first token seen by the client",
            ["mode"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "pd_router_request_duration_seconds",
            "End-to-end request latency",
            ["mode"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.legs = Histogram(
            "pd_router_leg_seconds",
            "Seconds from sending a leg to its answer (prefill: the whole answer; decode: its first byte)",
            ["mode", "role"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "pd_router_backend_in_flight",
            "Requests outstanding per backend",
            ["role", "backend"],
            registry=self.registry,
        )
        self.kv_held = Gauge(
            "pd_router_backend_kv_held",
            "Requests whose KV a prefill backend holds for a decode leg that has not started",
            ["role", "backend"],
            registry=self.registry,
        )
        self.draining = Gauge(
            "pd_router_backend_draining",
            "1 while a backend is out of the pool, finishing what it holds (scale-down)",
            ["role", "backend"],
            registry=self.registry,
        )
        self.leg_errors = Counter(
            "pd_router_leg_errors", "Failed prefill or decode legs", ["role", "kind"], registry=self.registry
        )
        self.transfer_failures = Counter(
            "pd_router_transfer_failures", "Requests failed by a KV transfer", registry=self.registry
        )
        self.transfers = Counter(
            "pd_router_transfers",
            "Successful requests by whether decode confirmed KV arrived by transfer",
            ["result"],
            registry=self.registry,
        )
        self.retries = Counter(
            "pd_router_retries",
            "Requests tried again on another pair before anything reached their client, by the role of the "
            "leg that failed and the cause (a failure kind, or kv_transfer)",
            ["role", "cause"],
            registry=self.registry,
        )
        self.retry_seconds = Counter(
            "pd_router_retry_seconds",
            "Seconds requests spent in attempts that failed and were retried, by cause",
            ["cause"],
            registry=self.registry,
        )

        self.prefix_tokens = Counter(
            "pd_router_prefix_tokens",
            "Cache-aware routing: prompt tokens routed to prefill (kind=prompt), those the chosen prefill "
            "was expected to hold cached (kind=cached) and, after them, in its KV tier (kind=tier)",
            ["kind"],
            registry=self.registry,
        )
        self.unhashed_prompts = Counter(
            "pd_router_unhashed_prompts",
            "Cache-aware routing: requests routed on load alone (their prompt could not be tokenized)",
            registry=self.registry,
        )
        self.kv_event_batches = Counter(
            "pd_router_kv_event_batches",
            "KV cache event batches received per engine, by outcome (gap/restart/malformed clear its index)",
            ["role", "backend", "outcome"],
            registry=self.registry,
        )

    def show_pool(self, backends: Iterable[Backend]) -> None:
        """Every configured backend's draining state (backends no longer configured are dropped)."""
        self.draining.clear()
        for backend in backends:
            self.draining.labels(backend.spec.role.value, backend.name).set(int(backend.spec.draining))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
