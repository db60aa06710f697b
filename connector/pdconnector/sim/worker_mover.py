"""The KV mover over the connector core: one :class:`pdconnector.worker.EngineTransfers` (a transfer worker
per TP rank plus the side channel) on the engine's pools, bridged to asyncio.

Worker calls never block (they enqueue); the worker reports each transfer's end once per rank through
``results()``, and pokes us through ``on_result`` from its own thread. A transfer has ended when every rank
has reported it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from pdconnector.protocol.messages import FailureReason
from pdconnector.protocol.params import PrefillCoordinates, TransferMode
from pdconnector.protocol.rendezvous import Outcome, RendezvousLimits
from pdconnector.sim.mover import ExportOutcome, Receipt, TransferFailed
from pdconnector.sim.pool import KVPool, PageBuffer
from pdconnector.transport.base import Device, MemoryRegion
from pdconnector.transport.factory import create_transport
from pdconnector.transport.mock_faults import MockFaults
from pdconnector.worker import EngineTransfers, ResultKind, TransferResult, WorkerConfig
from pdconnector.worker.identity import agent_name

log = logging.getLogger(__name__)

# How long past an import's deadline the worker may take to report it (its fence) before we stop waiting for
# it.
REPORT_GRACE_S = 300.0
# Decode failures that mean "it did not arrive in time": the request fails with the timeout code (HTTP 504).
_TIMED_OUT = frozenset({FailureReason.TIMEOUT, FailureReason.LEASE_EXPIRED, FailureReason.WRITE_TIMEOUT})


def memory_regions(pool: KVPool) -> list[list[MemoryRegion]]:
    """Per rank, the pool's buffers as regions to register (their addresses stay valid: the buffers never
    move)."""
    return [[_memory_region(buffer) for buffer in buffers] for buffers in pool.buffers]


def _memory_region(buffer: PageBuffer) -> MemoryRegion:
    if buffer.device_id is None:
        return MemoryRegion(buffer.address, buffer.nbytes)
    return MemoryRegion(buffer.address, buffer.nbytes, Device.VRAM, buffer.device_id)


@dataclass
class _Pending:
    """Results of one transfer, collected until every rank has reported."""

    ranks: int
    results: list[TransferResult] = field(default_factory=list)
    done: asyncio.Future[list[TransferResult]] | None = None
    on_done: Callable[[list[TransferResult]], None] | None = None
    # decode: the first rank whose receive failed while a peer may still write (the request is answered then)
    failing: asyncio.Future[TransferResult] | None = None


class WorkerMover:
    def __init__(
        self,
        transport: str,
        *,
        pool: KVPool,
        engine_id: str,
        host: str,
        side_channel_port: int,
        lease_s: float,
        fence_s: float = 60.0,
    ) -> None:
        self.pool = pool
        config = WorkerConfig(
            engine_id=engine_id,
            host=host,
            side_channel_port=side_channel_port,
            limits=RendezvousLimits(registration_lease_s=lease_s),
            pull_lease_s=lease_s,
            fence_s=fence_s,
        )

        def transport_factory(rank: int) -> object:
            # Runs on the rank's worker thread, which has bound its CUDA device already for VRAM pools.
            options = {"host": host, "faults": MockFaults.from_env(os.environ)} if transport == "mock" else {}
            return create_transport(transport, agent_name(engine_id, rank), **options)  # type: ignore[arg-type]

        self.transfers = EngineTransfers(
            pool.model,
            tp_size=pool.tp_size,
            num_blocks=pool.num_blocks,
            regions=memory_regions(pool),
            transport_factory=transport_factory,  # type: ignore[arg-type]
            config=config,
            on_result=self._poke,
        )
        self._pending: dict[str, _Pending] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._drainer: asyncio.Task[None] | None = None

    def peer_agents(self) -> int:
        """Peer agents the ranks' transports hold now (one per live peer rank: restarted peers' agents are
        dropped)."""
        return sum(worker.peer_agents() for worker in self.transfers.workers)

    def fenced(self) -> int:
        """Failed imports whose blocks are still held because a peer may still write into them."""
        return sum(worker.fenced() for worker in self.transfers.workers)

    def side_channel(self) -> PrefillCoordinates:
        return self.transfers.coordinates

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self.transfers.start)
        self._drainer = asyncio.create_task(self._drain())

    async def close(self) -> None:
        if self._drainer is not None:
            self._drainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drainer
        await asyncio.to_thread(self.transfers.close)

    # --- results from the worker threads --------------------------------------------------------------------
    def _poke(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _drain(self) -> None:
        while True:
            # The timeout is a safety net only: pokes normally wake us immediately.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.5)
            self._wake.clear()
            for worker in self.transfers.workers:
                for failure in worker.failing():
                    pending = self._pending.get(failure.transfer_id)
                    if pending is not None and pending.failing is not None and not pending.failing.done():
                        pending.failing.set_result(failure)
                for result in worker.results():
                    self._collect(result)

    def _collect(self, result: TransferResult) -> None:
        pending = self._pending.get(result.transfer_id)
        if pending is None:
            log.warning(
                "transfer result for an unknown transfer",
                extra={"transfer_id": result.transfer_id, "outcome": result.outcome},
            )
            return
        pending.results.append(result)
        if len(pending.results) < pending.ranks:
            return
        del self._pending[result.transfer_id]
        if pending.on_done is not None:
            pending.on_done(pending.results)
        if pending.done is not None and not pending.done.done():
            pending.done.set_result(pending.results)

    def _expect(
        self, transfer_id: str, on_done: Callable[[list[TransferResult]], None] | None = None
    ) -> _Pending:
        if transfer_id in self._pending:
            raise TransferFailed(f"transfer {transfer_id} is already in progress on this engine")
        pending = _Pending(ranks=len(self.transfers.workers), on_done=on_done)
        if on_done is None:
            pending.done = asyncio.get_running_loop().create_future()
            pending.failing = asyncio.get_running_loop().create_future()
        self._pending[transfer_id] = pending
        return pending

    # --- prefill --------------------------------------------------------------------------------------------
    def export_blocks(
        self,
        transfer_id: str,
        *,
        mode: TransferMode,
        block_ids: list[int],
        num_tokens: int,
        release: Callable[[ExportOutcome], None],
    ) -> None:

        def finished(results: list[TransferResult]) -> None:
            outcomes = {r.outcome for r in results}
            release(
                ExportOutcome.SENT
                if outcomes == {Outcome.WRITTEN}
                else ExportOutcome.EXPIRED
                if Outcome.EXPIRED in outcomes
                else ExportOutcome.FAILED
            )

        self._expect(transfer_id, on_done=finished)
        for worker in self.transfers.workers:
            worker.prefill_finished(transfer_id, [block_ids], num_tokens, pull=mode is TransferMode.PULL)

    # --- decode ---------------------------------------------------------------------------------------------
    async def _received(
        self,
        transfer_id: str,
        pending: _Pending,
        block_ids: list[int],
        deadline_s: float,
        free: Callable[[], None],
    ) -> Receipt:
        assert pending.done is not None and pending.failing is not None
        try:
            # The worker enforces deadline_s (and its fence) itself; our own bound only catches a worker that
            # stopped reporting. asyncio.wait leaves both futures running when it is cancelled.
            await asyncio.wait_for(
                asyncio.wait((pending.done, pending.failing), return_when=asyncio.FIRST_COMPLETED),
                deadline_s + REPORT_GRACE_S,
            )
        except (asyncio.CancelledError, TimeoutError) as error:
            # The request is gone (or the worker is stuck): cancel, and keep the blocks until the workers
            # report the transfer ended, which they do only once nothing can be written into them any more.
            for worker in self.transfers.workers:
                worker.cancel(transfer_id, "the decode request was cancelled")
            pending.done.add_done_callback(lambda _: free())
            if isinstance(error, TimeoutError):
                raise TransferFailed(
                    f"transfer {transfer_id}: the transfer workers did not report it", blocks_kept=True
                ) from None
            raise
        if not pending.done.done():
            # A rank's receive failed while a peer may still write into the blocks: the request is answered
            # now, the blocks freed once none can (as the vLLM connector does under the fail policy).
            failure = pending.failing.result()
            pending.done.add_done_callback(lambda _: free())
            raise TransferFailed(
                f"transfer {transfer_id} failed: {failure.outcome}: {failure.detail}",
                timed_out=failure.outcome in _TIMED_OUT,
                blocks_kept=True,
            )
        results = pending.done.result()
        failures = [r for r in results if r.kind is not ResultKind.FINISHED_RECVING]
        if failures:
            timed_out = all(r.outcome in _TIMED_OUT for r in failures)
            detail = "; ".join(sorted({f"{r.outcome}: {r.detail}" for r in failures}))
            raise TransferFailed(f"transfer {transfer_id} failed: {detail}", timed_out=timed_out)
        return Receipt(transfer_id=transfer_id, bytes=sum(r.nbytes for r in results), blocks=len(block_ids))

    async def import_pushed(
        self,
        transfer_id: str,
        *,
        remote: PrefillCoordinates,
        block_ids: list[int],
        num_tokens: int,
        deadline_s: float,
        free: Callable[[], None],
    ) -> Receipt:
        pending = self._expect(transfer_id)
        for worker in self.transfers.workers:
            worker.expect_push(transfer_id, remote, [block_ids], num_tokens, timeout_s=deadline_s)
        return await self._received(transfer_id, pending, block_ids, deadline_s, free)

    async def import_pulled(
        self,
        transfer_id: str,
        *,
        remote: PrefillCoordinates,
        remote_block_ids: list[int],
        block_ids: list[int],
        num_tokens: int,
        deadline_s: float,
        free: Callable[[], None],
    ) -> Receipt:
        pending = self._expect(transfer_id)
        for worker in self.transfers.workers:
            worker.read(
                transfer_id, remote, [remote_block_ids], [block_ids], num_tokens, timeout_s=deadline_s
            )
        return await self._received(transfer_id, pending, block_ids, deadline_s, free)
