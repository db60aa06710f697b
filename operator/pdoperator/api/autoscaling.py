"""``spec.autoscaling``: how many engines each role runs, decided by the operator (or by per-role HPA or KEDA
objects it renders) from the latency and queue targets the service must hold."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field

from pdoperator.api.base import ApiModel

MAX_ENGINES = 1024
MAX_PERCENT = 100 * MAX_ENGINES


class AutoscalingEngine(StrEnum):
    BUILTIN = "builtin"
    HPA = "hpa"
    KEDA = "keda"


class ReplicaRange(ApiModel):
    """How few and how many engines one role may run."""

    min_replicas: Annotated[
        int,
        Field(
            description="Fewest engines of this role (0: the role may scale to zero).", ge=0, le=MAX_ENGINES
        ),
    ] = 1
    max_replicas: Annotated[int, Field(description="Most engines of this role.", ge=1, le=MAX_ENGINES)]


class AutoscalingTargets(ApiModel):
    """What the service must hold. Prefill scales on TTFT and/or waiting prompts, decode on time per output
    token and/or running requests: each role needs at least one of its two."""

    percentile: Annotated[
        int,
        Field(
            description="Percentile of the latency targets over each scrape interval (e.g. 90: p90).",
            ge=50,
            le=99,
        ),
    ] = 90
    ttft_milliseconds: Annotated[
        int | None,
        Field(
            description="Time to first token, as the router measures it (prefill target; builtin and keda).",
            ge=1,
            le=3_600_000,
        ),
    ] = None
    tpot_milliseconds: Annotated[
        int | None,
        Field(
            description="Time per output token, as the decode engines measure it (decode target; builtin and "
            "keda).",
            ge=1,
            le=60_000,
        ),
    ] = None
    waiting_requests_per_prefill: Annotated[
        int | None,
        Field(
            description="Prompts waiting per prefill engine (vllm:num_requests_waiting; prefill target).",
            ge=1,
            le=65536,
        ),
    ] = None
    running_requests_per_decode: Annotated[
        int | None,
        Field(
            description="Requests running per decode engine (vllm:num_requests_running; decode target).",
            ge=1,
            le=65536,
        ),
    ] = None


class RatioRange(ApiModel):
    """Prefill engines per decode engine the builtin planner keeps, in percent (50: one prefill engine per two
    decode engines; 200: two per one)."""

    min_percent: Annotated[
        int, Field(description="Fewest prefill engines per decode engine, in percent.", ge=0, le=MAX_PERCENT)
    ] = 0
    max_percent: Annotated[
        int, Field(description="Most prefill engines per decode engine, in percent.", ge=1, le=MAX_PERCENT)
    ]


class PrometheusSource(ApiModel):
    """The Prometheus that scrapes this service's router and engines (what KEDA's triggers query)."""

    server_address: Annotated[
        str,
        Field(
            description="Prometheus HTTP API base URL, e.g. http://prometheus.monitoring.svc:9090.",
            min_length=1,
            max_length=2048,
            pattern=r"^https?://",
        ),
    ]


class AutoscalingSpec(ApiModel):
    """The operator sizes both roles; with this set, spec.prefill.replicas and spec.decode.replicas are only
    where the roles start."""

    engine: Annotated[
        AutoscalingEngine,
        Field(
            description=(
                "builtin: the operator's planner sizes both roles together, keeps the ratio range and "
                "drains an engine in the router before removing it. hpa / keda: a HorizontalPodAutoscaler "
                "or KEDA ScaledObject per role, rendered for you; no ratio, no drain."
            )
        ),
    ] = AutoscalingEngine.BUILTIN
    prefill: Annotated[ReplicaRange, Field(description="Bounds of the prefill engines.")]
    decode: Annotated[ReplicaRange, Field(description="Bounds of the decode engines.")]
    targets: Annotated[AutoscalingTargets, Field(description="Latency and queue targets.")]
    prefill_per_decode: Annotated[
        RatioRange | None,
        Field(description="Range of prefill engines per decode engine (builtin only); unset: any ratio."),
    ] = None
    scale_up_window_seconds: Annotated[
        int,
        Field(
            description="A role scales up to the smallest need seen over this window (a load that lasted, "
            "not a spike).",
            ge=0,
            le=3600,
        ),
    ] = 30
    scale_down_window_seconds: Annotated[
        int,
        Field(
            description="A role scales down to the largest need seen over this window, once it served "
            "through the whole window with the engines it has; a step keeps at least half of them.",
            ge=0,
            le=86400,
        ),
    ] = 300
    tolerance_percent: Annotated[
        int,
        Field(
            description="A signal within this many percent of its target holds the replicas (builtin; an "
            "HPA, also KEDA's, uses the cluster's tolerance, 10 % unless its controller says otherwise).",
            ge=0,
            le=99,
        ),
    ] = 10
    drain_timeout_seconds: Annotated[
        int,
        Field(
            description="Longest a draining engine (out of the router's pool, finishing its requests and KV "
            "transfers) is kept before it is removed anyway (builtin).",
            ge=0,
            le=86400,
        ),
    ] = 600
    prometheus: Annotated[
        PrometheusSource | None, Field(description="Where KEDA's triggers query (keda only).")
    ] = None
