"""The connector's transfer stats, as vLLM's stats pipeline uses them: recorded per rank, summed over ranks,
shipped as a plain dict, rebuilt in the API process, logged as one line and exported to Prometheus."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from pdconnector.protocol.messages import FailureReason
from pdconnector.protocol.rendezvous import Outcome
from pdconnector.vllm.connector import PDConnector
from pdconnector.vllm.stats import MAX_WAITS, Direction, PDPromMetrics, PDTransferStats, TokenSource
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


def decode_rank0() -> PDTransferStats:
    stats = PDTransferStats()
    stats.record(Direction.RECV, Outcome.RECEIVED, wait_s=0.02, nbytes=4096)
    stats.record(Direction.RECV, Outcome.RECEIVED, wait_s=0.04, nbytes=8192)
    stats.record(Direction.RECV, FailureReason.TIMEOUT, wait_s=30.0)
    return stats


def test_rank_zero_counts_each_ending_by_direction_and_outcome_with_its_wait_and_bytes() -> None:
    assert decode_rank0().data == {
        "ended": {"recv/received": 2, "recv/timeout": 1},
        "bytes_received": 12288,
        "waits": {"send": [], "recv": [0.02, 0.04, 30.0]},
        "events": {},
        "stages": {},
        "tokens": {},
    }


def test_other_ranks_count_only_their_bytes_so_a_sharded_transfer_counts_once() -> None:
    stats = PDTransferStats()
    stats.record(Direction.RECV, Outcome.RECEIVED, wait_s=None, nbytes=4096)
    assert stats.data == {
        "ended": {},
        "bytes_received": 4096,
        "waits": {"send": [], "recv": []},
        "events": {},
        "stages": {},
        "tokens": {},
    }
    assert not stats.is_empty()


def test_aggregating_ranks_sums_counts_and_bytes_and_joins_waits_without_touching_either_side() -> None:
    rank0, rank1 = decode_rank0(), PDTransferStats()
    rank1.record(Direction.RECV, Outcome.RECEIVED, wait_s=None, nbytes=12288)
    before = msgspec.json.encode(rank0.data), msgspec.json.encode(rank1.data)
    total = rank0.aggregate(rank1).aggregate(PDTransferStats())
    assert total.data["ended"] == {"recv/received": 2, "recv/timeout": 1}
    assert total.data["bytes_received"] == 24576
    assert total.data["waits"]["recv"] == [0.02, 0.04, 30.0]
    assert (msgspec.json.encode(rank0.data), msgspec.json.encode(rank1.data)) == before


def test_take_hands_over_what_was_recorded_once_and_nothing_when_idle() -> None:
    stats = decode_rank0()
    taken = stats.take()
    assert taken is not None and taken.data["ended"] == {"recv/received": 2, "recv/timeout": 1}
    assert stats.is_empty()
    assert stats.take() is None


def test_the_waits_one_object_keeps_are_bounded() -> None:
    stats = PDTransferStats()
    for _ in range(MAX_WAITS + 10):
        stats.record(Direction.SEND, Outcome.WRITTEN, wait_s=0.001)
    assert len(stats.data["waits"]["send"]) == MAX_WAITS
    assert stats.data["ended"] == {"send/written": MAX_WAITS + 10}


def test_the_payload_survives_vllms_msgpack_round_trip_and_is_rebuilt_by_the_connector_class() -> None:
    payload = msgspec.msgpack.decode(msgspec.msgpack.encode(decode_rank0().to_dict()))
    rebuilt = PDConnector.build_kv_connector_stats(payload)
    assert isinstance(rebuilt, PDTransferStats)
    assert rebuilt.data == decode_rank0().data
    empty = PDConnector.build_kv_connector_stats()
    assert isinstance(empty, PDTransferStats) and empty.is_empty()


def test_the_log_line_summarises_counts_mebibytes_and_wait_percentiles() -> None:
    assert decode_rank0().reduce() == {
        "recv_received": 2,
        "recv_timeout": 1,
        "received_MiB": 0.012,
        "recv_wait_p50_ms": 40.0,
        "recv_wait_max_ms": 30000.0,
    }
    prefill = PDTransferStats()
    prefill.record(Direction.SEND, Outcome.WRITTEN, wait_s=0.01)
    assert prefill.reduce() == {"send_written": 1, "send_wait_p50_ms": 10.0, "send_wait_max_ms": 10.0}


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def prom_metrics(registry: CollectorRegistry) -> PDPromMetrics:
    metric_types: dict[type, Any] = {
        cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)
    }
    config: Any = SimpleNamespace(kv_transfer_config=None)
    return PDConnector.build_prom_metrics(
        config, metric_types, ["model_name", "engine"], {0: ["tiny", "0"], 1: ["tiny", "1"]}
    )


def test_prometheus_counts_transfers_bytes_and_waits_per_engine(registry: CollectorRegistry) -> None:
    metrics = prom_metrics(registry)
    metrics.observe(decode_rank0().to_dict(), engine_idx=1)
    metrics.observe(decode_rank0().to_dict(), engine_idx=1)
    engine1 = {"model_name": "tiny", "engine": "1"}
    assert (
        registry.get_sample_value(
            "vllm:pd_kv_transfers_total", {**engine1, "direction": "recv", "outcome": "received"}
        )
        == 4
    )
    assert (
        registry.get_sample_value(
            "vllm:pd_kv_transfers_total", {**engine1, "direction": "recv", "outcome": "timeout"}
        )
        == 2
    )
    assert registry.get_sample_value("vllm:pd_kv_received_bytes_total", engine1) == 2 * 12288
    assert (
        registry.get_sample_value("vllm:pd_kv_transfer_wait_seconds_count", {**engine1, "direction": "recv"})
        == 6
    )
    assert (
        registry.get_sample_value(
            "vllm:pd_kv_transfer_wait_seconds_bucket", {**engine1, "direction": "recv", "le": "0.025"}
        )
        == 2
    )
    assert (
        registry.get_sample_value("vllm:pd_kv_received_bytes_total", {"model_name": "tiny", "engine": "0"})
        is None
    )
    assert (
        registry.get_sample_value("vllm:pd_kv_transfer_wait_seconds_count", {**engine1, "direction": "send"})
        is None
    )


def test_fence_events_are_summed_over_ranks_logged_and_exported(registry: CollectorRegistry) -> None:
    rank0, rank1 = PDTransferStats(), PDTransferStats()
    rank0.count_events({"fences_expired": 1, "writes_stuck": 0})
    rank1.count_events({"fences_expired": 2, "reads_stuck": 1})
    assert PDTransferStats().is_empty() and not rank0.is_empty()  # an event alone is worth shipping
    total = rank0.aggregate(rank1)
    assert total.data["events"] == {"fences_expired": 3, "reads_stuck": 1}
    assert total.reduce()["fences_expired"] == 3
    prom_metrics(registry).observe(total.to_dict(), engine_idx=0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert (
        registry.get_sample_value("vllm:pd_kv_fence_events_total", {**labels, "event": "fences_expired"}) == 3
    )
    assert registry.get_sample_value("vllm:pd_kv_fence_events_total", {**labels, "event": "reads_stuck"}) == 1


def test_decode_tokens_by_source_and_tier_events_are_summed_logged_and_exported(
    registry: CollectorRegistry,
) -> None:
    scheduler, rank0, rank1 = PDTransferStats(), PDTransferStats(), PDTransferStats()
    scheduler.record_tokens({TokenSource.GPU: 128, TokenSource.TIER: 512, TokenSource.REMOTE: 40})
    scheduler.record_tokens({TokenSource.TIER: 0, TokenSource.REMOTE: 300})
    assert not scheduler.is_empty()  # the scheduler's counts alone are worth shipping
    rank0.count_events({"tier_loads_failed": 1})
    rank1.count_events({"tier_saves_failed": 2})
    total = scheduler.aggregate(rank0).aggregate(rank1)
    assert total.data["tokens"] == {"gpu": 128, "tier": 512, "remote": 340}
    summary = total.reduce()
    assert (summary["tier_tokens"], summary["remote_tokens"], summary["tier_saves_failed"]) == (512, 340, 2)
    prom_metrics(registry).observe(
        msgspec.msgpack.decode(msgspec.msgpack.encode(total.to_dict())), engine_idx=0
    )
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:pd_kv_tokens_total", {**labels, "source": "tier"}) == 512
    assert registry.get_sample_value("vllm:pd_kv_tokens_total", {**labels, "source": "remote"}) == 340
    for event, count in (("tier_loads_failed", 1), ("tier_saves_failed", 2)):
        assert registry.get_sample_value("vllm:pd_kv_tier_events_total", {**labels, "event": event}) == count
    assert (
        registry.get_sample_value("vllm:pd_kv_fence_events_total", {**labels, "event": "tier_loads_failed"})
        is None
    )


def test_stages_from_ranks_and_the_scheduler_are_joined_logged_as_medians_and_exported(
    registry: CollectorRegistry,
) -> None:
    worker, scheduler = PDTransferStats(), PDTransferStats()
    worker.record(Direction.RECV, Outcome.RECEIVED, wait_s=0.004)
    worker.record_stages({"handshake": 0.0001, "kv_wait": 0.003})
    worker.record_stages({"handshake": 0.0003, "kv_wait": 0.005})
    scheduler.record_stages({"resume": 0.002})
    assert not scheduler.is_empty()  # the scheduler's stages alone are worth shipping
    total = worker.aggregate(scheduler)
    assert total.data["stages"] == {
        "handshake": [0.0001, 0.0003],
        "kv_wait": [0.003, 0.005],
        "resume": [0.002],
    }
    assert worker.data["stages"]["kv_wait"] == [0.003, 0.005]  # aggregating copies
    summary = total.reduce()
    assert (summary["handshake_p50_ms"], summary["kv_wait_p50_ms"], summary["resume_p50_ms"]) == (
        0.2,
        4.0,
        2.0,
    )
    prom_metrics(registry).observe(
        msgspec.msgpack.decode(msgspec.msgpack.encode(total.to_dict())), engine_idx=0
    )
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:pd_kv_stage_seconds_count", {**labels, "stage": "kv_wait"}) == 2
    assert (
        registry.get_sample_value(
            "vllm:pd_kv_stage_seconds_bucket", {**labels, "stage": "kv_wait", "le": "0.0025"}
        )
        == 0
    )
    assert (
        registry.get_sample_value(
            "vllm:pd_kv_stage_seconds_bucket", {**labels, "stage": "kv_wait", "le": "0.005"}
        )
        == 2
    )
    assert registry.get_sample_value(
        "vllm:pd_kv_stage_seconds_sum", {**labels, "stage": "resume"}
    ) == pytest.approx(0.002)
