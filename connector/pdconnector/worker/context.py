"""What the two sides of one rank's transfer worker share: the rank (layout, memory), its transport, the
results out, the counters.

:class:`~pdconnector.worker.prefill_side.PrefillSide` and :class:`~pdconnector.worker.decode_side.DecodeSide`
never call each other; each holds this context and reports through it, sends its notifications
through it (ringing the peer's doorbell after each, :mod:`pdconnector.worker.doorbell`) and releases its
transfer handles through it. The transport and this rank's identity
(:class:`RankInfo`) are bound once, on the worker thread, when the transport is registered; every
call that touches them runs on that thread. :meth:`WorkerContext.take_results` and
:meth:`WorkerContext.stats` are the only parts other threads call.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from pdconnector.layout import RankLayout
from pdconnector.protocol.messages import AbortMessage, FailureMessage, FailureReason, encode
from pdconnector.protocol.rendezvous import Outcome
from pdconnector.transport.base import (
    MemoryRegion,
    TransferHandle,
    TransferState,
    TransferStatus,
    Transport,
    TransportError,
)
from pdconnector.worker.doorbell import Ringer
from pdconnector.worker.identity import RankInfo, fingerprint, layout_summary
from pdconnector.worker.staging import StagingBuffer

log = logging.getLogger(__name__)


class ResultKind(StrEnum):
    FINISHED_SENDING = "finished_sending"  # prefill: the blocks may be freed (whatever the outcome)
    FINISHED_RECVING = "finished_recving"  # decode: every byte landed
    FAILED_RECVING = "failed_recving"  # decode: the transfer will not complete; free / recompute


@dataclass(frozen=True)
class TransferResult:
    """One transfer's end on this rank, reported exactly once.

    ``outcome``: for sending, an :class:`~pdconnector.protocol.rendezvous.Outcome`
    (written/failed/expired/cancelled/rejected); for receiving, ``Outcome.RECEIVED`` or a
    :class:`~pdconnector.protocol.messages.FailureReason`. ``nbytes``: bytes received. ``stages``: seconds per
    :class:`~pdconnector.protocol.timeline.Stage` the transfer passed through on this rank.
    """

    transfer_id: str
    kind: ResultKind
    outcome: Outcome | FailureReason
    detail: str
    nbytes: int = 0
    stages: dict[str, float] = field(default_factory=dict)


class WorkerContext:
    """Args:
    layout: this rank's KV layout; ``regions``: its memory regions in ``layout.regions`` order (one device).
    on_result: called (on the worker thread) after every reported result, to wake whoever drains them.
    staging: the rank's staging buffer, with the path and costs that choose it (None: every transfer goes
    direct).
    """

    def __init__(
        self,
        layout: RankLayout,
        regions: Sequence[MemoryRegion],
        *,
        on_result: Callable[[], None] | None = None,
        staging: StagingBuffer | None = None,
    ) -> None:
        self.layout = layout
        self.staging = staging
        # registrations carry it, the rendezvous compares it
        self.layout_fingerprint = fingerprint(layout_summary(layout.model))
        # the local side of every descriptor
        self.region_addrs = np.array([r.addr for r in regions], dtype=np.int64)
        self.device_id = regions[0].device_id if regions else 0
        self._on_result = on_result
        self._results: queue.SimpleQueue[TransferResult] = queue.SimpleQueue()
        self._failing: queue.SimpleQueue[TransferResult] = queue.SimpleQueue()
        self._counters: Counter[str] = Counter()
        self._counters_lock = threading.Lock()
        self._transport: Transport | None = None
        self._own: RankInfo | None = None
        self._stranded: list[TransferHandle] = []  # abandoned transfers the transport could not release yet
        self._doorbells: dict[str, tuple[str, int]] = {}  # peer agent -> its doorbell (host, UDP port)
        self.sent_at = float("-inf")  # monotonic time of the last notification sent
        self._ringer = Ringer()

    def bind(self, transport: Transport, own: RankInfo) -> None:
        """The registered transport and what the side channel serves for this rank (worker thread, once)."""
        self._transport, self._own = transport, own

    @property
    def transport(self) -> Transport:
        if self._transport is None:
            raise RuntimeError("transfer worker not started")
        return self._transport

    @property
    def own(self) -> RankInfo:
        """This rank as its peers reach it (agent, metadata, region addresses, device)."""
        if self._own is None:
            raise RuntimeError("transfer worker not started")
        return self._own

    # --- results and counters (take_results / stats: any thread) --------------------------------------------

    def report(self, result: TransferResult) -> None:
        self.count(result.kind.value)
        self._results.put(result)
        if self._on_result is not None:
            self._on_result()

    def take_results(self) -> list[TransferResult]:
        return _drain(self._results)

    def announce_failing(self, failure: TransferResult) -> None:
        """A receive failed while a peer may still write into its blocks (the fence): its request may be
        answered now; the transfer's end is reported later, once, as usual."""
        self._failing.put(failure)
        if self._on_result is not None:
            self._on_result()

    def take_failing(self) -> list[TransferResult]:
        return _drain(self._failing)

    def count(self, name: str, n: int = 1) -> None:
        with self._counters_lock:
            self._counters[name] += n

    def stats(self) -> dict[str, int]:
        with self._counters_lock:
            return dict(self._counters)

    # --- the transport (worker thread) ----------------------------------------------------------------------

    def give_back_slot(self, holder: Hashable) -> None:
        """Free the staging slot ``holder`` holds, if any (no buffer: nothing to do)."""
        if self.staging is not None:
            self.staging.give_back(holder)

    def send(self, agent: str, message: FailureMessage | AbortMessage) -> bool:
        return self.send_frame(agent, encode(message))

    def send_frame(self, agent: str, frame: bytes) -> bool:
        """Notify ``agent`` and ring its doorbell; False (logged) when the transport refused."""
        try:
            self.transport.notify(agent, frame)
        except TransportError as error:
            log.warning("notification to %s not sent: %s", agent, error)
            return False
        self.sent_at = time.monotonic()
        self.ring(agent)
        return True

    def set_doorbell(self, agent: str, host: str, port: int) -> None:
        """Where ``agent``'s doorbell is (port 0: it has none)."""
        if port:
            self._doorbells[agent] = (host, port)

    def forget_doorbell(self, agent: str) -> None:
        self._doorbells.pop(agent, None)

    def ring(self, agent: str) -> None:
        """Wake ``agent``'s transfer thread: a notification to it is on its way (sent, or riding a transfer
        that ended)."""
        doorbell = self._doorbells.get(agent)
        if doorbell is not None and self._ringer.ring(*doorbell):
            self.count("doorbells_rung")

    def state(self, handle: TransferHandle) -> TransferStatus:
        """The transfer's state; a transport that cannot say counts as a failed transfer."""
        try:
            return self.transport.state(handle)
        except TransportError as error:
            return TransferStatus(TransferState.FAILED, f"polling failed: {error}")

    def release(self, handle: TransferHandle) -> None:
        """Release ``handle``; one the transport cannot release yet is kept and retried by
        :meth:`retry_stranded`."""
        try:
            self.transport.release(handle)
        except TransportError as error:
            log.info("transfer %s not released yet (%s); will retry", handle.id, error)
            self._stranded.append(handle)

    def cancel(self, handle: TransferHandle) -> bool:
        """Stop and release a transfer in flight; False when the transport cannot stop it (the handle stays
        live)."""
        try:
            self.transport.release(handle)
        except TransportError as error:
            log.warning("transfer %s to %s cannot be cancelled: %s", handle.id, handle.peer, error)
            return False
        return True

    def retry_stranded(self) -> bool:
        """Retry the handles :meth:`release` could not release; whether any of them went."""
        if not self._stranded:
            return False
        stranded, self._stranded = self._stranded, []
        for handle in stranded:
            self.release(handle)
        return len(self._stranded) < len(stranded)

    def close(self, in_flight: Iterable[TransferHandle]) -> None:
        """Release the sides' transfers still in flight and the stranded ones, then close the transport."""
        transport = self.transport
        for handle in [*in_flight, *self._stranded]:
            try:
                transport.release(handle)
            except TransportError as error:
                log.info("closing with transfer %s still in flight: %s", handle.id, error)
        try:
            transport.close()
        except TransportError as error:
            log.warning("closing transport %s: %s", transport.name, error)
        self._ringer.close()


def _drain(results: queue.SimpleQueue[TransferResult]) -> list[TransferResult]:
    out = []
    while True:
        try:
            out.append(results.get_nowait())
        except queue.Empty:
            return out
