"""End-to-end push latency through the transfer workers, in both orders the two halves of a push can meet.

Run: ``python -m pdconnector.bench.worker_bench [--repeat N] [--tokens 1024,4096,16384] [--transports
mock,nixl]``.

Two engines in this process (prefill TP 1, decode TP 1 or 2), each rank with its own worker and
transport, host memory. *Registration first* (decode registered while prefill computed): the clock
runs from ``prefill_finished`` until the last decode rank's result is drained, which includes
planning, posting, the copy, the completion notification and the workers' wake-ups. *Prefill
first* (prefill finished and went idle, decode registers later): the clock runs from
``expect_push``, so the registration's trip to an idle prefill is in it, which is where a polling
timer would show. Model: 16 attention layers, 8 KV heads x 128, bf16, block 16 (64 KiB per block
per layer at TP 1), so 16k tokens move 1 GiB per request.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid

from pdconnector.layout import AttentionSpec, KVModel, LayerKind, RankLayout, allocate_pools
from pdconnector.transport.base import MemoryRegion
from pdconnector.transport.factory import TransportKind, create_transport
from pdconnector.worker import EngineTransfers, ResultKind, WorkerConfig

MODEL = KVModel(
    (LayerKind.ATTENTION,) * 16,
    block_size=16,
    attention=AttentionSpec(num_kv_heads=8, head_dim=128, dtype_bytes=2),
)


class _Engine:
    def __init__(self, name: str, kind: TransportKind, tp: int, num_blocks: int) -> None:
        self.pools = [allocate_pools(RankLayout(MODEL, tp, rank, num_blocks)) for rank in range(tp)]
        regions = [[MemoryRegion(p.ctypes.data, p.nbytes) for p in pools] for pools in self.pools]
        suffix = uuid.uuid4().hex[:6]
        self.arrived = threading.Condition()
        self.transfers = EngineTransfers(
            MODEL,
            tp_size=tp,
            num_blocks=num_blocks,
            regions=regions,
            transport_factory=lambda rank: create_transport(kind, f"{name}-{rank}-{suffix}"),
            config=WorkerConfig(engine_id=name, side_channel_port=0),
            on_result=self._notify,
        )
        self.transfers.start()

    def _notify(self) -> None:
        with self.arrived:
            self.arrived.notify_all()

    def wait_all(self, timeout_s: float) -> list[ResultKind]:
        deadline = time.monotonic() + timeout_s
        kinds: list[ResultKind] = []
        with self.arrived:
            while len(kinds) < len(self.transfers.workers) and time.monotonic() < deadline:
                for worker in self.transfers.workers:
                    kinds += [r.kind for r in worker.results()]
                if len(kinds) < len(self.transfers.workers):
                    self.arrived.wait(0.01)
        return kinds


IDLE_S = 0.2  # how long prefill sits idle with its blocks before decode registers (prefill first)


def measure(
    kind: TransportKind, decode_tp: int, tokens: list[int], repeat: int, *, prefill_first: bool
) -> dict[int, list[float]]:
    blocks_needed = -(-max(tokens) // MODEL.block_size)
    prefill = _Engine("bench-prefill", kind, 1, blocks_needed)
    decode = _Engine("bench-decode", kind, decode_tp, blocks_needed)
    out: dict[int, list[float]] = {}
    registered = 0
    try:
        decode.transfers.client.prewarm(prefill.transfers.coordinates).result(timeout=30)
        for n in tokens:
            ids = [list(range(-(-n // MODEL.block_size)))]
            samples = []
            for i in range(repeat + 1):  # the first run warms connections up and is dropped
                transfer_id = f"tx-{kind}-{n}-{i}-{prefill_first}"
                if prefill_first:
                    prefill.transfers.workers[0].prefill_finished(transfer_id, ids, n)
                    time.sleep(IDLE_S)
                    start = time.perf_counter()
                    for worker in decode.transfers.workers:
                        worker.expect_push(transfer_id, prefill.transfers.coordinates, ids, n, timeout_s=60)
                else:
                    for worker in decode.transfers.workers:
                        worker.expect_push(transfer_id, prefill.transfers.coordinates, ids, n, timeout_s=60)
                    registered += decode_tp
                    while prefill.transfers.workers[0].stats().get("registrations_received", 0) < registered:
                        time.sleep(0.001)
                    start = time.perf_counter()
                    prefill.transfers.workers[0].prefill_finished(transfer_id, ids, n)
                kinds = decode.wait_all(60)
                elapsed = time.perf_counter() - start
                prefill.wait_all(10)
                if kinds != [ResultKind.FINISHED_RECVING] * decode_tp:
                    raise RuntimeError(f"{kind} {n} tokens: transfer failed: {kinds}")
                if i:
                    samples.append(elapsed)
            out[n] = samples
    finally:
        decode.transfers.close()
        prefill.transfers.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokens", default="1024,4096,16384")
    parser.add_argument("--transports", default="mock,nixl")
    parser.add_argument("--decode-tp", type=int, default=1)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    bytes_per_token = MODEL.attention.bytes_per_token * len(MODEL.layers) if MODEL.attention else 0
    kinds = args.transports.split(",")
    for prefill_first in (False, True):
        results = {
            kind: measure(kind, args.decode_tp, tokens, args.repeat, prefill_first=prefill_first)
            for kind in kinds
        }
        clock = (
            "decode registers (prefill idle for 0.2 s)"
            if prefill_first
            else "prefill finished (decode registered)"
        )
        print(
            f"push: prefill TP1 -> decode TP{args.decode_tp}, {clock} -> all decode ranks received, median "
            f"of {args.repeat}"
        )
        print(
            f"{'tokens':>7} {'MiB':>7} "
            + " ".join(f"{kind + ' p50 ms':>14} {kind + ' GiB/s':>11}" for kind in results)
        )
        for n in tokens:
            mib = n * bytes_per_token / 2**20
            cells = []
            for samples in results.values():
                p50 = statistics.median(samples[n])
                cells.append(f"{p50 * 1e3:14.2f} {mib / 1024 / p50:11.2f}")
            print(f"{n:7d} {mib:7.0f} " + " ".join(cells))


if __name__ == "__main__":
    main()
