"""From ``/metrics`` text to the planner's :class:`~pdoperator.autoscale.planner.Sample`: what one scrape
interval of the router and the engines says. Pure: texts and times in, numbers out.

The router times every request's first token (``pd_router_ttft_seconds``); each decode engine its time per
output token (vLLM's ``vllm:request_time_per_output_token_seconds``); each engine the requests it holds
waiting and running (``vllm:num_requests_waiting``, ``vllm:num_requests_running``). Latency percentiles are
those of the interval between two scrapes, from the difference of their cumulative histograms, interpolated
inside the bucket as Prometheus' ``histogram_quantile`` does; a histogram that went down (its process
restarted) counts from zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from pdoperator.autoscale.planner import Sample

ROUTER_TTFT = "pd_router_ttft_seconds"
ENGINE_TPOT = "vllm:request_time_per_output_token_seconds"
ENGINE_WAITING = "vllm:num_requests_waiting"
ENGINE_RUNNING = "vllm:num_requests_running"
ROUTER_IN_FLIGHT = "pd_router_backend_in_flight"
ROUTER_KV_HELD = "pd_router_backend_kv_held"
ROUTER_DRAINING = "pd_router_backend_draining"


@dataclass(frozen=True)
class Histogram:
    """Cumulative counts at each upper bound (``+Inf`` last), summed over a family's label sets."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def since(self, earlier: Histogram | None) -> Histogram:
        """The observations after ``earlier`` (all of them when there is none, its buckets differ, or this one
        counts fewer: a restart)."""
        if earlier is None or earlier.bounds != self.bounds or earlier.count > self.count:
            return self
        return Histogram(self.bounds, tuple(a - b for a, b in zip(self.counts, earlier.counts, strict=True)))

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0 < q < 1) by linear interpolation in its bucket; None without observations.
        Past the last finite bound it is that bound, as Prometheus answers."""
        if not 0 < q < 1:
            raise ValueError(f"quantile must lie in (0, 1), got {q}")
        if self.count <= 0:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            if count >= rank:
                if math.isinf(bound):
                    return lower_bound
                if count == lower_count:
                    return bound
                return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
            lower_bound, lower_count = bound, count
        return lower_bound


@dataclass(frozen=True)
class EngineReading:
    waiting: float
    running: float
    tpot: Histogram | None


@dataclass(frozen=True)
class Scrape:
    """Everything read at ``at``: the router's TTFT, and per role what each engine (by pod name) said."""

    at: float
    ttft: Histogram | None
    prefill: Mapping[str, EngineReading]
    decode: Mapping[str, EngineReading]


def histogram(text: str, name: str) -> Histogram | None:
    """The histogram family ``name`` in an exposition text, summed over its label sets; None if absent."""
    per_bound: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name or family.type != "histogram":
            continue
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                bound = float(sample.labels["le"])
                per_bound[bound] = per_bound.get(bound, 0.0) + sample.value
    if not per_bound:
        return None
    bounds = tuple(sorted(per_bound))
    return Histogram(bounds, tuple(per_bound[b] for b in bounds))


def gauge(text: str, name: str) -> float:
    """The gauge family ``name`` summed over its label sets (0 if absent)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for sample in family.samples
        if sample.name == name
    )


@dataclass(frozen=True)
class BackendLoad:
    """What the router says of one engine: out of its pool or not, and the requests still on it (legs in
    flight, and prefill KV that decode has not taken yet)."""

    draining: bool
    requests: float


def router_backends(text: str) -> dict[str, BackendLoad]:
    """Per engine (pod name), the router's view, from its ``/metrics`` text."""
    per_backend: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in (ROUTER_IN_FLIGHT, ROUTER_KV_HELD, ROUTER_DRAINING):
            for sample in family.samples:
                if sample.name == family.name and "backend" in sample.labels:
                    values = per_backend.setdefault(sample.labels["backend"], {})
                    values[family.name] = values.get(family.name, 0.0) + sample.value
    return {
        name: BackendLoad(
            draining=values.get(ROUTER_DRAINING, 0.0) > 0,
            requests=values.get(ROUTER_IN_FLIGHT, 0.0) + values.get(ROUTER_KV_HELD, 0.0),
        )
        for name, values in per_backend.items()
    }


def is_idle(load: BackendLoad | None, engine: EngineReading | None) -> bool:
    """A draining engine may go: the router took it out of its pool and nothing is left on it, there or in
    the engine itself (which also counts other routers' requests). An engine that does not answer holds
    nothing that could still complete."""
    if load is None or not load.draining or load.requests > 0:
        return False
    return engine is None or engine.waiting + engine.running == 0


def engine_reading(text: str) -> EngineReading:
    return EngineReading(
        gauge(text, ENGINE_WAITING), gauge(text, ENGINE_RUNNING), histogram(text, ENGINE_TPOT)
    )


def scrape(at: float, router: str, prefill: Mapping[str, str], decode: Mapping[str, str]) -> Scrape:
    """A :class:`Scrape` from the router's and each engine's ``/metrics`` text (engines by pod name)."""
    return Scrape(
        at,
        histogram(router, ROUTER_TTFT),
        {name: engine_reading(text) for name, text in prefill.items()},
        {name: engine_reading(text) for name, text in decode.items()},
    )


def sample(earlier: Scrape | None, later: Scrape, percentile: float) -> Sample:
    """The planner's view of the interval ending at ``later``: latency percentiles of the requests in it (None
    where none ended), the queues as ``later`` saw them, the engines that answered."""
    q = percentile / 100
    ttft = later.ttft.since(earlier.ttft if earlier else None).quantile(q) if later.ttft else None
    # each engine's own interval first: engines come, go and restart between scrapes
    before = earlier.decode if earlier else {}
    intervals = [
        reading.tpot.since(before[name].tpot if name in before else None)
        for name, reading in later.decode.items()
        if reading.tpot is not None
    ]
    tpot_interval = _summed(intervals)
    tpot = tpot_interval.quantile(q) if tpot_interval else None
    return Sample(
        at=later.at,
        prefill_replicas=len(later.prefill),
        decode_replicas=len(later.decode),
        ttft_s=ttft,
        tpot_s=tpot,
        prefill_waiting=sum(r.waiting for r in later.prefill.values()),
        decode_running=sum(r.running for r in later.decode.values()),
    )


def _summed(histograms: Sequence[Histogram]) -> Histogram | None:
    """Histograms of several engines added bucket by bucket (those with other buckets than the first left out:
    one deployment's engines share vLLM's buckets)."""
    if not histograms:
        return None
    first = histograms[0]
    same = [h for h in histograms if h.bounds == first.bounds]
    return Histogram(first.bounds, tuple(sum(h.counts[i] for h in same) for i in range(len(first.bounds))))
