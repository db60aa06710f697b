"""The mock engine's capacity: what makes it queue, slow down and report load like vLLM's scheduler.

A real engine is bounded in two ways, and an autoscaler scales on both: prefill compute is a token throughput
(one engine prefills so many prompt tokens per second, however they are batched), and decode runs at most
``--max-num-seqs`` requests at once, each step taking longer as the batch grows. Here prefill runs one
prompt at a time for ``prefill_s_per_token`` per token; decode steps take ``decode_s_per_token`` times
``1 + batch_slowdown * (running - 1)``. Requests beyond either bound wait, and the engine reports them as
vLLM does (``vllm:num_requests_waiting``, ``vllm:num_requests_running``). A request that finds the KV pool
full waits for blocks up to ``kv_wait_s`` (vLLM keeps it waiting; 0 refuses it at once).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdconnector.sim.pool import KVPool, OutOfBlocks


@dataclass(frozen=True)
class LatencyModel:
    prefill_s_per_token: float = 0.0
    decode_s_per_token: float = 0.0
    batch_slowdown: float = 0.0  # extra step time per other running request, as a fraction of one step


class Scheduler:
    """Admission and pacing of one engine's requests (one event loop: no locking beyond asyncio's)."""

    def __init__(self, latency: LatencyModel, max_num_seqs: int, kv_wait_s: float = 0.0) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        self.latency = latency
        self.max_num_seqs = max_num_seqs
        self.kv_wait_s = kv_wait_s
        self.waiting = 0
        self.running = 0
        self._prefill = asyncio.Lock()
        self._slots = asyncio.Semaphore(max_num_seqs)
        self._freed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def blocks_freed(self) -> None:
        """Blocks went back to the pool (called from any thread): requests waiting for blocks try again."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._freed.set)

    async def allocate(self, pool: KVPool, num_tokens: int) -> list[int]:
        """A request's KV blocks, waiting while the pool is full up to ``kv_wait_s``; raises OutOfBlocks after
        that, or at once for a request the whole pool could never hold."""
        self._loop = asyncio.get_running_loop()
        deadline = self._loop.time() + self.kv_wait_s
        if pool.blocks_for(num_tokens) > pool.num_blocks:
            return pool.allocate(num_tokens)  # raises: it can never fit
        self.waiting += 1
        try:
            while True:
                try:
                    return pool.allocate(num_tokens)
                except OutOfBlocks:
                    remaining = deadline - self._loop.time()
                    if remaining <= 0:
                        raise
                # no await since the failed allocation: no free can have been missed
                self._freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._freed.wait(), remaining)
        finally:
            self.waiting -= 1

    @contextlib.asynccontextmanager
    async def _admitted(self, gate: asyncio.Lock | asyncio.Semaphore) -> AsyncIterator[None]:
        self.waiting += 1
        try:
            await gate.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            gate.release()

    async def prefill(self, num_tokens: int) -> None:
        """Compute a prompt's KV: after those queued before it, ``prefill_s_per_token`` per token."""
        if self.latency.prefill_s_per_token <= 0:
            return
        async with self._admitted(self._prefill):
            await asyncio.sleep(self.latency.prefill_s_per_token * num_tokens)

    def generating(self) -> contextlib.AbstractAsyncContextManager[None]:
        """A decode slot, held while a request generates (one of ``max_num_seqs``)."""
        return self._admitted(self._slots)

    async def decode_step(self) -> None:
        # A zero-latency model still yields, so streams interleave with other requests as on a real engine.
        batch = max(1, self.running)
        await asyncio.sleep(self.latency.decode_s_per_token * (1 + self.latency.batch_slowdown * (batch - 1)))
