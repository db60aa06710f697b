"""Reading the planner's samples off real exposition text: the router's TTFT and the engines' TPOT percentiles
of the interval between two scrapes, queues summed over engines and label sets, restarts counted from zero."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pdconnector.router.metrics import LATENCY_BUCKETS
from pdoperator.autoscale.signals import (
    ENGINE_RUNNING,
    ENGINE_TPOT,
    ENGINE_WAITING,
    ROUTER_TTFT,
    Histogram,
    gauge,
    histogram,
    sample,
    scrape,
)
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client import Histogram as PromHistogram

TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class Router:
    """A router's TTFT histogram, labelled by mode like the real one."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft = PromHistogram(
            ROUTER_TTFT, "ttft", ["mode"], buckets=LATENCY_BUCKETS, registry=self.registry
        )

    def text(self) -> str:
        return generate_latest(self.registry).decode()


class Engine:
    """An engine's queue gauges and TPOT histogram, labelled by model and engine index like vLLM's."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.waiting = Gauge(ENGINE_WAITING, "waiting", labels, registry=self.registry)
        self.running = Gauge(ENGINE_RUNNING, "running", labels, registry=self.registry)
        self.tpot = PromHistogram(ENGINE_TPOT, "tpot", labels, buckets=TPOT_BUCKETS, registry=self.registry)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def bucket_of(value: float, bounds: tuple[float, ...]) -> tuple[float, float]:
    """The (lower, upper] bucket holding ``value``; past the last bound, the last bound twice."""
    lower = 0.0
    for bound in bounds:
        if value <= bound:
            return lower, bound
        lower = bound
    return bounds[-1], bounds[-1]


latencies = st.lists(st.floats(0.0005, 200.0, allow_nan=False), min_size=0, max_size=60)


@settings(max_examples=200, deadline=None)
@given(
    latencies, latencies.filter(bool), st.sampled_from([50.0, 90.0, 99.0]), st.sampled_from(["push", "pull"])
)
def test_the_interval_percentile_lies_in_the_bucket_of_the_true_one(
    before: list[float], during: list[float], percentile: float, mode: str
) -> None:
    router = Router()
    for value in before:
        router.ttft.labels("push").observe(value)
    first = scrape(10.0, router.text(), {}, {})
    for value in during:
        router.ttft.labels(mode).observe(value)
    second = scrape(20.0, router.text(), {}, {})
    estimate = sample(first, second, percentile).ttft_s
    rank = math.ceil(percentile / 100 * len(during))
    low, high = bucket_of(sorted(during)[rank - 1], LATENCY_BUCKETS)
    assert estimate is not None and low <= estimate <= high, (estimate, low, high)


def test_an_interval_without_requests_has_no_latency_and_a_restart_counts_from_zero() -> None:
    router = Router()
    for _ in range(10):
        router.ttft.labels("push").observe(3.0)
    first = scrape(0.0, router.text(), {}, {})
    assert sample(first, scrape(5.0, router.text(), {}, {}), 90).ttft_s is None
    restarted = Router()
    restarted.ttft.labels("push").observe(0.02)
    # fewer observations than before: a new process, whose every observation is in the interval
    assert sample(first, scrape(10.0, restarted.text(), {}, {}), 90).ttft_s == pytest.approx(0.0235)


def test_queues_sum_over_engines_and_label_sets_and_each_engine_counts_its_own_interval() -> None:
    kept, restarted, joined = Engine(), Engine(), Engine()
    for engine in (kept, restarted):
        for _ in range(20):
            engine.tpot.labels("tiny", "0").observe(0.5)  # slow, before the interval
    first = scrape(0.0, "", {}, {"d-0": kept.text(), "d-1": restarted.text()})
    fresh = Engine()  # d-1 restarted: its histogram starts over
    for engine in (kept, fresh, joined):
        for _ in range(10):
            engine.tpot.labels("tiny", "0").observe(0.03)
    kept.running.labels("tiny", "0").set(5)
    kept.running.labels("tiny", "1").set(2)
    joined.running.labels("tiny", "0").set(4)
    prefill = Engine()
    prefill.waiting.labels("tiny", "0").set(7)
    second = scrape(
        5.0, "", {"p-0": prefill.text()}, {"d-0": kept.text(), "d-1": fresh.text(), "d-2": joined.text()}
    )
    got = sample(first, second, 90)
    assert (got.prefill_replicas, got.decode_replicas) == (1, 3)
    assert (got.prefill_waiting, got.decode_running) == (7, 11)
    # only the interval's 30 fast tokens: the 40 slow ones before it and d-1's lost history do not count
    assert got.tpot_s is not None and 0.025 < got.tpot_s <= 0.05


def test_absent_families_read_as_nothing_and_quantiles_outside_zero_one_are_refused() -> None:
    assert histogram("", ROUTER_TTFT) is None
    assert gauge("", ENGINE_WAITING) == 0
    none = scrape(0.0, "", {}, {})
    assert sample(None, none, 90).ttft_s is None and sample(None, none, 90).tpot_s is None
    with pytest.raises(ValueError, match=r"quantile must lie in \(0, 1\)"):
        Histogram((1.0, math.inf), (1.0, 1.0)).quantile(1.0)
