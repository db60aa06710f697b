"""The mock engine's Prometheus metrics: pool occupancy (so tests can prove no blocks leak), transfer, request
and token counters, and the load and latency vLLM reports under its own names (what the autoscaler reads)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdconnector.sim.mover import KVMover
from pdconnector.sim.pool import KVPool

# vLLM's buckets of vllm:request_time_per_output_token_seconds.
TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class EngineMetrics:
    def __init__(self, pool: KVPool, mover: KVMover | None = None) -> None:
        self.registry = CollectorRegistry()
        total = Gauge("pd_mock_kv_blocks_total", "Blocks in the KV pool", registry=self.registry)
        total.set(pool.num_blocks)
        free = Gauge("pd_mock_kv_blocks_free", "Free blocks in the KV pool", registry=self.registry)
        free.set_function(lambda: pool.free_blocks)
        self.held_blocks = Gauge(
            "pd_mock_kv_blocks_held_for_transfer",
            "Prefill blocks waiting for a decode engine",
            registry=self.registry,
        )
        self.transfers = Counter(
            "pd_mock_transfers",
            "KV transfers by direction and outcome",
            ["direction", "outcome"],
            registry=self.registry,
        )
        self.transfer_bytes = Counter(
            "pd_mock_transfer_bytes", "KV bytes moved", ["direction"], registry=self.registry
        )
        # outcome: ok, error, or cancelled (the client went away before the answer was complete)
        self.requests = Counter(
            "pd_mock_requests", "Requests by kind and outcome", ["kind", "outcome"], registry=self.registry
        )
        # Stops growing when a request's client goes away: proof that the engine stopped working for it.
        self.generation_tokens = Counter(
            "pd_mock_generation_tokens", "Output tokens generated", registry=self.registry
        )
        # set by the engine from its scheduler
        self.requests_waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled", registry=self.registry
        )
        self.requests_running = Gauge(
            "vllm:num_requests_running", "Requests in prefill or generating", registry=self.registry
        )
        self.time_per_output_token = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Per request: seconds between output tokens after the first",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        if mover is not None:
            agents = Gauge(
                "pd_mock_peer_agents",
                "Peer agents the transports hold (restarted peers' are dropped)",
                registry=self.registry,
            )
            agents.set_function(mover.peer_agents)
            fenced = Gauge(
                "pd_mock_fenced_transfers",
                "Failed imports whose blocks wait until no peer can write them",
                registry=self.registry,
            )
            fenced.set_function(mover.fenced)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
