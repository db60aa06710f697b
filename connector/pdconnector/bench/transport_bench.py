"""Post-to-completion time of one transfer between two processes over host memory, NIXL and
MockTransport side by side.

Run: ``python -m pdconnector.bench.transport_bench [--mib 1] [--descriptors 1,64,1024] [--repeat 50]``.

The target agent lives in a spawned child process that drives its own progress with back-off
(as the transfer worker does); this process posts a WRITE or READ of ``--mib`` MiB split into N
equal descriptors, spaced so that no two are adjacent (nothing can be merged), and polls
``state()`` until DONE. The figure is the time from ``write()``/``read()`` to DONE.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from pdconnector.transport import (
    MemoryRegion,
    Operation,
    TransferState,
    Transport,
    create_transport,
    nixl_unavailable_reason,
)


def _serve(kind: str, nbytes: int, conn: Connection) -> None:
    """Child process: one agent owning ``nbytes`` of host memory, progressing until told to stop."""
    agent = create_transport(kind, f"bench-target-{kind}")  # type: ignore[arg-type]
    buffer = np.zeros(nbytes, dtype=np.uint8)
    agent.register([MemoryRegion(buffer.ctypes.data, nbytes)])
    conn.send((agent.metadata(), buffer.ctypes.data))
    idle_s = 0.0005
    while not conn.poll(idle_s):
        idle_s = 0.0005 if agent.take_notifications() else min(idle_s * 2, 0.01)
    agent.close()


@dataclass(frozen=True)
class Row:
    kind: str
    operation: Operation
    descriptors: int
    nbytes: int
    seconds: list[float]

    def line(self) -> str:
        median, p90 = (
            statistics.median(self.seconds),
            sorted(self.seconds)[int(0.9 * (len(self.seconds) - 1))],
        )
        rate = self.nbytes / median / 1e9
        size = self.nbytes / 2**20
        return (
            f"{self.kind:<6}{self.operation.value:<7}{self.descriptors:>8}{size:>8.2f}"
            f"{median * 1e3:>12.3f}{p90 * 1e3:>10.3f}{rate:>10.2f}"
        )


HEADER = f"{'kind':<6}{'op':<7}{'descs':>8}{'MiB':>8}{'median ms':>12}{'p90 ms':>10}{'GB/s':>10}"


def _spaced(base: int, count: int, length: int) -> np.ndarray:
    rows = np.zeros((count, 3), dtype=np.int64)
    rows[:, 0] = base + np.arange(count, dtype=np.int64) * 2 * length
    rows[:, 1] = length
    return rows


def _time_transfers(
    agent: Transport, peer: str, operation: Operation, local: np.ndarray, remote: np.ndarray, *, repeat: int
) -> list[float]:
    post = agent.write if operation is Operation.WRITE else agent.read
    seconds = []
    for i in range(repeat + 3):
        start = time.perf_counter()
        handle = post(peer, local, remote, b"bench")
        while (status := agent.state(handle)).state is TransferState.IN_PROGRESS:
            # Yield the GIL: a spinning poller would starve MockTransport's receiving thread (5 ms switch
            # interval).
            time.sleep(0)
        elapsed = time.perf_counter() - start
        agent.release(handle)
        if status.state is not TransferState.DONE:
            raise RuntimeError(f"{operation.value} failed: {status.error}")
        if i >= 3:  # the first transfers pay for connection set-up
            seconds.append(elapsed)
    return seconds


def bench_kind(kind: str, nbytes: int, descriptor_counts: Sequence[int], repeat: int) -> list[Row]:
    span = 2 * nbytes  # descriptors are spaced one length apart
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    child = context.Process(target=_serve, args=(kind, span, child_end), daemon=True)
    child.start()
    agent = create_transport(kind, f"bench-initiator-{kind}")  # type: ignore[arg-type]
    try:
        if not parent_end.poll(60):
            raise RuntimeError(f"{kind} target process did not start within 60 s")
        metadata, remote_base = parent_end.recv()
        buffer = np.ones(span, dtype=np.uint8)
        agent.register([MemoryRegion(buffer.ctypes.data, span)])
        peer = agent.add_peer(metadata)
        rows = []
        for count in descriptor_counts:
            length = nbytes // count
            local, remote = _spaced(buffer.ctypes.data, count, length), _spaced(remote_base, count, length)
            for operation in (Operation.WRITE, Operation.READ):
                rows.append(
                    Row(
                        kind,
                        operation,
                        count,
                        length * count,
                        _time_transfers(agent, peer, operation, local, remote, repeat=repeat),
                    )
                )
        return rows
    finally:
        agent.close()
        parent_end.send("stop")
        child.join(10)
        if child.is_alive():
            child.kill()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=1.0, help="bytes per transfer, in MiB")
    parser.add_argument("--descriptors", default="1,64,1024", help="comma-separated descriptor counts")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--kinds", default="nixl,mock")
    args = parser.parse_args(argv)
    nbytes = int(args.mib * 2**20)
    counts = [int(c) for c in args.descriptors.split(",")]
    print(HEADER)
    for kind in args.kinds.split(","):
        if kind == "nixl" and (reason := nixl_unavailable_reason()):
            print(f"{kind:<6}skipped: {reason}")
            continue
        for row in bench_kind(kind, nbytes, counts, args.repeat):
            print(row.line(), flush=True)


if __name__ == "__main__":
    main()
