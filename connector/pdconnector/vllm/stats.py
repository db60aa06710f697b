"""Transfer telemetry in vLLM's own stats pipeline: the engine's log line and its ``/metrics``.

Each rank's :class:`~pdconnector.vllm.worker.WorkerSide` records how its transfers ended.
vLLM takes the records after every step (``get_kv_connector_stats``), sums them over the
ranks (:meth:`PDTransferStats.aggregate`) and ships them to the API process as a plain dict.
There they become one log line per interval (:meth:`PDTransferStats.reduce`) and Prometheus
series (:class:`PDPromMetrics`).

Only rank 0 counts transfers and their waits, so a TP-sharded transfer counts once. Every
rank counts its bytes, because each moves its own shard, and its fence events (:data:`FENCE_EVENTS`:
blocks released by the fence without the peer's answer, transfers the transport could not cancel,
registrations sent without their inline metadata to fit the backend's notification limit) and staged-path
events (:data:`STAGING_EVENTS`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from pdconnector.protocol.messages import FailureReason
from pdconnector.protocol.rendezvous import Outcome

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# A KV wait runs from a few milliseconds (a block or two over host memory) to the transfer timeout.
WAIT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A stage of a transfer (pdconnector.protocol.timeline) takes from tens of microseconds (a post) to the
# timeout.
STAGE_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0)
# How many waits one stats object keeps between two reads; vLLM reads them after every step, so this only
# bounds a stalled reader.
MAX_WAITS = 4096


# Transfer-worker counters that say the fence had to act; exported as vllm:pd_kv_fence_events{event=...}.
FENCE_EVENTS = ("fences_expired", "writes_stuck", "reads_stuck", "registrations_without_metadata")
# ... and the staged path's: WRITEs gathered through a slot, requests too large for a slot, none free;
# exported as vllm:pd_kv_staging_events{event=...}.
STAGING_EVENTS = ("writes_staged", "staging_too_large", "staging_slots_busy")
COUNTED_EVENTS = FENCE_EVENTS + STAGING_EVENTS
# ... and the KV tier's, counted by the worker side itself: loads that fell back to the full transfer, saves
# that failed on a rank; exported as vllm:pd_kv_tier_events{event=...}.
TIER_EVENTS = ("tier_loads_failed", "tier_saves_failed")


class TokenSource(StrEnum):
    """Where an engine took a request's prompt tokens from (counted once it finished, by
    :class:`~pdconnector.vllm.prompt_tokens.PromptTokens`): decode's from its prefix cache, its tier and
    prefill (its own forward where a failed receive was recomputed); prefill's (with a tier) from its prefix
    cache, its tier and its own forward."""

    GPU = "gpu"  # vLLM's own prefix cache
    TIER = "tier"  # the engine's KV tier in host memory
    REMOTE = "remote"  # prefill, over the transfer
    COMPUTED = "computed"  # the engine's own forward


class Direction(StrEnum):
    SEND = "send"  # prefill: from prefill done to its blocks released (written, read, expired, ...)
    RECV = "recv"  # decode: from asking for the KV to having it, or to the failure


def _empty() -> dict[str, Any]:
    return {
        "ended": {},
        "bytes_received": 0,
        "waits": {direction.value: [] for direction in Direction},
        "events": {},
        "stages": {},
        "tokens": {},
    }


@dataclass
class PDTransferStats(KVConnectorStats):
    """``data``: ``ended`` maps ``"<direction>/<outcome>"`` to a count, ``bytes_received`` sums the bytes that
    arrived, ``waits`` holds each direction's wait in seconds, ``stages`` each stage's durations in seconds
    (:class:`~pdconnector.protocol.timeline.Stage`). Plain JSON-like values: vLLM serialises them."""

    data: dict[str, Any] = field(default_factory=_empty)

    def record(
        self, direction: Direction, outcome: Outcome | FailureReason, *, wait_s: float | None, nbytes: int = 0
    ) -> None:
        """One transfer's end on one rank; ``wait_s`` is None on ranks that do not count transfers."""
        self.data["bytes_received"] += nbytes
        if wait_s is None:
            return
        key = f"{direction.value}/{outcome}"
        self.data["ended"][key] = self.data["ended"].get(key, 0) + 1
        waits = self.data["waits"][direction.value]
        if len(waits) < MAX_WAITS:
            waits.append(wait_s)

    def record_stages(self, stages: dict[str, float]) -> None:
        """Where one transfer's time went (a stage name -> seconds), on the rank that counts transfers."""
        for name, seconds in stages.items():
            durations = self.data["stages"].setdefault(name, [])
            if len(durations) < MAX_WAITS:
                durations.append(seconds)

    def record_tokens(self, tokens: dict[TokenSource, int]) -> None:
        """Prompt tokens of one request by source (scheduler side: counted once per request)."""
        for source, count in tokens.items():
            if count:
                self.data["tokens"][source.value] = self.data["tokens"].get(source.value, 0) + count

    def count_events(self, events: dict[str, int]) -> None:
        """Events of one rank since the last count (names from :data:`COUNTED_EVENTS`)."""
        for name, count in events.items():
            if count:
                self.data["events"][name] = self.data["events"].get(name, 0) + count

    def reset(self) -> None:
        self.data = _empty()

    def take(self) -> PDTransferStats | None:
        """What was recorded since the last take, or None if nothing was."""
        if self.is_empty():
            return None
        taken = PDTransferStats(self.data)
        self.reset()
        return taken

    def is_empty(self) -> bool:
        return (
            not self.data["ended"]
            and not self.data["bytes_received"]
            and not self.data["events"]
            and not self.data["stages"]
            and not self.data.get("tokens")
        )

    def aggregate(self, other: KVConnectorStats) -> PDTransferStats:
        ended, events = dict(self.data["ended"]), dict(self.data["events"])
        tokens = dict(self.data.get("tokens", {}))
        for key, count in other.data["ended"].items():
            ended[key] = ended.get(key, 0) + count
        for key, count in other.data.get("events", {}).items():
            events[key] = events.get(key, 0) + count
        for key, count in other.data.get("tokens", {}).items():
            tokens[key] = tokens.get(key, 0) + count
        waits = {
            direction: self.data["waits"][direction] + other.data["waits"][direction]
            for direction in self.data["waits"]
        }
        stages = {name: list(durations) for name, durations in self.data["stages"].items()}
        for name, durations in other.data.get("stages", {}).items():
            stages[name] = stages.get(name, []) + durations
        bytes_received = self.data["bytes_received"] + other.data["bytes_received"]
        return PDTransferStats(
            {
                "ended": ended,
                "bytes_received": bytes_received,
                "waits": waits,
                "events": events,
                "stages": stages,
                "tokens": tokens,
            }
        )

    def reduce(self) -> dict[str, int | float]:
        summary: dict[str, int | float] = {
            key.replace("/", "_"): count for key, count in sorted(self.data["ended"].items())
        }
        summary.update(sorted(self.data["events"].items()))
        summary.update({f"{source}_tokens": n for source, n in sorted(self.data.get("tokens", {}).items())})
        if self.data["bytes_received"]:
            summary["received_MiB"] = round(self.data["bytes_received"] / 2**20, 3)
        for direction, waits in self.data["waits"].items():
            if waits:
                summary[f"{direction}_wait_p50_ms"] = round(statistics.median(waits) * 1e3, 2)
                summary[f"{direction}_wait_max_ms"] = round(max(waits) * 1e3, 2)
        for name, durations in sorted(self.data["stages"].items()):
            summary[f"{name}_p50_ms"] = round(statistics.median(durations) * 1e3, 3)
        return summary


class PDPromMetrics(KVConnectorPromMetrics):
    """The connector's series on the engine's ``/metrics``, labelled like vLLM's own (model name, engine
    index)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._transfers = self._counter_cls(
            name="vllm:pd_kv_transfers",
            documentation="KV transfers of the PD connector that ended, by direction (send: prefill, recv: "
            "decode) and outcome.",
            labelnames=[*labelnames, "direction", "outcome"],
        )
        self._bytes = self._counter_cls(
            name="vllm:pd_kv_received_bytes",
            documentation="KV bytes that arrived at this engine by the PD connector (padding never crosses "
            "the wire, so never counted).",
            labelnames=labelnames,
        )
        self._waits = self._histogram_cls(
            name="vllm:pd_kv_transfer_wait_seconds",
            documentation="Seconds a request waited on its KV transfer: decode from asking to arrival, "
            "prefill from done to blocks freed.",
            buckets=list(WAIT_BUCKETS_S),
            labelnames=[*labelnames, "direction"],
        )
        self._fence_events = self._counter_cls(
            name="vllm:pd_kv_fence_events",
            documentation="Times the fence acted: blocks released without the peer's answer "
            "(fences_expired), transfers the "
            "transport could not cancel (writes_stuck, reads_stuck), registrations sent without inline "
            "metadata.",
            labelnames=[*labelnames, "event"],
        )
        self._staging_events = self._counter_cls(
            name="vllm:pd_kv_staging_events",
            documentation="The staged path: WRITEs gathered through a staging slot (writes_staged), "
            "requests larger than a slot (staging_too_large) or finding none free (staging_slots_busy), "
            "which went direct.",
            labelnames=[*labelnames, "event"],
        )
        self._tier_events = self._counter_cls(
            name="vllm:pd_kv_tier_events",
            documentation="The KV tier: loads that failed on a rank, so decode took the full transfer or "
            "prefill recomputed the blocks (tier_loads_failed), saves that failed on a rank, so the blocks "
            "were not kept (tier_saves_failed).",
            labelnames=[*labelnames, "event"],
        )
        self._tokens = self._counter_cls(
            name="vllm:pd_kv_tokens",
            documentation="Prompt tokens of disaggregated requests by where the engine took them from: "
            "vLLM's prefix cache (gpu), the engine's KV tier (tier), prefill over the transfer (remote, on "
            "decode), its own forward (computed: on prefill with a tier, on decode where a failed transfer "
            "was recomputed); counted once a request finished, a request that failed unserved not at all.",
            labelnames=[*labelnames, "source"],
        )
        self._stages = self._histogram_cls(
            name="vllm:pd_kv_stage_seconds",
            documentation="Seconds a transfer spent in each stage of its timeline "
            "(pdconnector.protocol.timeline), on this engine.",
            buckets=list(STAGE_BUCKETS_S),
            labelnames=[*labelnames, "stage"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, count in transfer_stats_data["ended"].items():
            direction, outcome = key.split("/", 1)
            self._transfers.labels(*labels, direction, outcome).inc(count)
        if transfer_stats_data["bytes_received"]:
            self._bytes.labels(*labels).inc(transfer_stats_data["bytes_received"])
        for event, count in transfer_stats_data.get("events", {}).items():
            if event in STAGING_EVENTS:
                counter = self._staging_events
            elif event in TIER_EVENTS:
                counter = self._tier_events
            else:
                counter = self._fence_events
            counter.labels(*labels, event).inc(count)
        for source, count in transfer_stats_data.get("tokens", {}).items():
            self._tokens.labels(*labels, source).inc(count)
        for direction, waits in transfer_stats_data["waits"].items():
            if waits:
                histogram = self._waits.labels(*labels, direction)
                for wait in waits:
                    histogram.observe(wait)
        for name, durations in transfer_stats_data.get("stages", {}).items():
            histogram = self._stages.labels(*labels, name)
            for seconds in durations:
                histogram.observe(seconds)
