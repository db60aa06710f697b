"""The transfer worker: one background thread per engine rank that owns the rank's transport.

Every agent call happens on this thread (agents are not thread-safe). The engine talks to it
only through non-blocking calls that enqueue a command (:mod:`pdconnector.worker.commands`), and
drains :meth:`TransferWorker.results` once per step, so an engine step never waits for the network.
This module is the thread: its inbox, its loop and its clock. The loop hands each command and each
incoming notification to the side it is for, with its own monotonic clock ``now``, and polls and
expires both sides every turn:

* :class:`~pdconnector.worker.prefill_side.PrefillSide`: :meth:`prefill_finished` (push: pair with
  registrations; pull: hold for READs), :meth:`cancel`; results of kind ``finished_sending`` mean
  "these blocks may be freed now".
* :class:`~pdconnector.worker.decode_side.DecodeSide`: :meth:`expect_push` (register with every writing
  prefill rank, count completions), :meth:`read` (pull: READ from every source rank, then tell prefill
  it may free); results ``finished_recving`` / ``failed_recving``.

An engine uses one role; nothing stops a rank doing both. The sides share only the
:class:`~pdconnector.worker.context.WorkerContext` (transport, results, counters, notifications, handle
release) and the :class:`~pdconnector.worker.peers.PeerRegistry` (the peer agents loaded).

Failure semantics: every wait has a deadline, every failure frees what it held and tells the
peer (a ``FailureMessage`` or an ``AbortMessage``) so nobody waits out a timeout when a prompt
answer is possible. Wake-ups: the thread waits on its input queue, which the engine's commands,
answered handshakes and the rank's doorbell (:mod:`pdconnector.worker.doorbell`, rung by peers after
each notification they send it) fill, so a registration or completion is taken the moment it can
have arrived. It polls only while a transfer may be moving (a WRITE or READ in flight ends only
in the transport's state, and the agent on the other end of one may have to progress too), and for
``MESSAGE_WINDOW_S`` after it sent a notification or heard a ring (a notification may need this
agent's progress to leave, or arrive after its ring); then the wait grows from ``min_poll_s`` to
``busy_poll_max_s``. Otherwise it waits ``idle_poll_max_s``
(what a lost ring costs at most), always bounded by the next deadline, so an idle worker costs
next to no CPU and one waiting for a registration wakes when it comes.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdconnector.layout import RankLayout
from pdconnector.protocol.messages import (
    MAX_DETAIL_CHARS,
    AbortMessage,
    CompletionMessage,
    FailureMessage,
    ProtocolError,
    ReadDoneMessage,
    RegistrationMessage,
    decode,
    rejection_notice,
)
from pdconnector.protocol.params import PrefillCoordinates
from pdconnector.protocol.rendezvous import RendezvousLimits
from pdconnector.transport.base import Device, MemoryRegion, Transport, TransportError
from pdconnector.transport.cuda import bind_cuda_device
from pdconnector.worker.commands import AbandonTransfer, CancelTransfer, ExpectPush, PrefillDone, ReadBlocks
from pdconnector.worker.context import TransferResult, WorkerContext
from pdconnector.worker.decode_side import DecodeSide
from pdconnector.worker.doorbell import Doorbell
from pdconnector.worker.identity import EngineInfo, RankInfo
from pdconnector.worker.liveness import Heartbeat
from pdconnector.worker.peers import PeerRegistry
from pdconnector.worker.prefill_side import PrefillSide
from pdconnector.worker.side_channel import SideChannelClient
from pdconnector.worker.staging import StagingBuffer, StagingConfig

log = logging.getLogger(__name__)

# How long the thread keeps polling after it sent a notification (UCX may need the sender's progress to
# connect and send it) or heard a ring (which can overtake the notification it announces: UCX sends a WRITE's
# notification as a message of its own after the data, the mock transport delivers on its receiver thread).
MESSAGE_WINDOW_S = 0.05

BlockIds = Sequence[Sequence[int]]


@dataclass(frozen=True)
class WorkerConfig:
    engine_id: str
    host: str = "127.0.0.1"  # this rank's node: its doorbell listens here, registrations and RankInfo name it
    side_channel_port: int = 5600
    limits: RendezvousLimits = field(default_factory=RendezvousLimits)
    pull_lease_s: float = 30.0
    fence_s: float = 60.0  # how long decode keeps a failed push's blocks for a writer that never answers
    heartbeat_dir: str | None = None  # where the liveness heartbeat goes (pdconnector.worker.liveness)
    min_poll_s: float = 1e-4
    busy_poll_max_s: float = 2e-3
    # Only a lost ring (or a peer known by name, which is never rung) waits this long. Each idle wake-up costs
    # ~0.37 ms of CPU per rank on the CI machine: ~0.1 ms is any timed wait there (a bare time.sleep wake-up
    # costs 86 us of thread CPU), the rest is one turn's ~90 Python calls (NIXL's notification poll ~20 us of
    # it). At 50 ms an idle two-rank engine measured 1.6-2.2% of a core, past the 2% budget; at 100 ms ~1%.
    idle_poll_max_s: float = 0.1
    start_timeout_s: float = 60.0
    staging: StagingConfig = field(default_factory=StagingConfig)  # the staged path (off without nbytes)


# --- the inbox (engine thread -> worker thread): the transfer commands and these ----------------------------


@dataclass(frozen=True)
class _Receive:
    """A decode command, when the engine issued it and its deadline (both on the engine's monotonic clock,
    which the worker thread shares)."""

    command: ExpectPush | ReadBlocks | AbandonTransfer
    deadline: float
    issued_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class _AddPeers:
    engine: EngineInfo


@dataclass(frozen=True)
class _Wake:
    pass


_Command = PrefillDone | CancelTransfer | _Receive | _AddPeers | _Wake


def _tuple_blocks(blocks: BlockIds) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(b) for b in group) for group in blocks)


class TransferWorker:
    """One engine rank's transfers. Construct, :meth:`start`, call the role methods from any thread, drain
    :meth:`results`."""

    def __init__(
        self,
        layout: RankLayout,
        regions: Sequence[MemoryRegion],
        transport_factory: Callable[[], Transport],
        *,
        config: WorkerConfig,
        side_channel: SideChannelClient | None = None,
        on_result: Callable[[], None] | None = None,
    ) -> None:
        if len(regions) != len(layout.regions):
            raise ValueError(
                f"layout has {len(layout.regions)} regions, {len(regions)} memory regions were given"
            )
        for region, expected in zip(regions, layout.regions, strict=True):
            if region.nbytes < expected.nbytes:
                raise ValueError(
                    f"memory region {expected.index} has {region.nbytes} bytes, the layout needs "
                    f"{expected.nbytes}"
                )
        devices = {(r.device, r.device_id) for r in regions}
        if len(devices) > 1:
            raise ValueError(
                "the memory regions of one rank must live on one device, got "
                f"{sorted(f'{kind}:{index}' for kind, index in devices)}"
            )
        self.layout = layout
        self.config = config
        self._regions = tuple(regions)
        self._transport_factory = transport_factory
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"transfer-worker-{config.engine_id}-{layout.tp_rank}", daemon=True
        )
        staging = StagingBuffer(regions, config.staging) if config.staging.nbytes else None
        self._context = WorkerContext(layout, regions, on_result=on_result, staging=staging)
        self.layout_fingerprint = self._context.layout_fingerprint
        # Everything below belongs to the worker thread.
        self._peers = PeerRegistry(self._context)
        self._prefill = PrefillSide(
            self._context, self._peers, limits=config.limits, pull_lease_s=config.pull_lease_s
        )
        self._decode = DecodeSide(
            self._context,
            self._peers,
            side_channel=side_channel,
            wake=self._wake,
            engine_id=config.engine_id,
            host=config.host,
            side_channel_port=config.side_channel_port,
            fence_s=config.fence_s,
        )
        self._heartbeat = Heartbeat(config.heartbeat_dir, layout.tp_rank)
        self._fenced = self._peer_agents = 0  # published by the thread each turn, read by others

    # --- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> RankInfo:
        """Start the thread, create and register the transport on it; returns what the side channel serves for
        this rank."""
        self._thread.start()
        if not self._ready.wait(self.config.start_timeout_s):
            self._stop.set()
            raise TimeoutError(
                f"transfer worker rank {self.layout.tp_rank}: transport not ready within "
                f"{self.config.start_timeout_s}s"
            )
        if self._start_error is not None:
            raise RuntimeError(
                f"transfer worker rank {self.layout.tp_rank}: transport start failed: {self._start_error}"
            ) from self._start_error
        return self._context.own

    @property
    def rank_info(self) -> RankInfo:
        return self._context.own

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread, release transfers still in flight and close the transport."""
        self._stop.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # --- inputs (any thread, never block) -------------------------------------------------------------------

    def prefill_finished(
        self, transfer_id: str, block_ids: BlockIds, num_tokens: int, *, pull: bool = False
    ) -> None:
        """Prefill of ``transfer_id`` is done: hold ``block_ids`` (one list per KV group) until decode has
        them or a lease ends."""
        self._put(PrefillDone("", transfer_id, _tuple_blocks(block_ids), num_tokens, pull))

    def cancel(self, transfer_id: str, detail: str = "cancelled by the engine") -> None:
        """Give up on ``transfer_id`` (either role): free, tell the peer, report the end."""
        self._put(CancelTransfer("", transfer_id, detail[:MAX_DETAIL_CHARS]))

    def abandon(
        self, transfer_id: str, prefill: PrefillCoordinates, detail: str, *, timeout_s: float = 10.0
    ) -> None:
        """Decode: a request of ``transfer_id`` ended before it registered or read anything; tell
        ``prefill``'s ranks at once so they free the blocks they hold for it (within ``timeout_s``, else
        prefill frees at its lease)."""
        self._put(
            _Receive(
                AbandonTransfer("", transfer_id, prefill, detail[:MAX_DETAIL_CHARS]),
                time.monotonic() + timeout_s,
            )
        )

    def expect_push(
        self,
        transfer_id: str,
        prefill: PrefillCoordinates,
        block_ids: BlockIds,
        num_tokens: int,
        *,
        timeout_s: float,
        attempt: int = 0,
        cached_blocks: int = 0,
    ) -> None:
        """Decode (push): register ``block_ids`` with every prefill rank writing this rank and wait for their
        completions.

        ``cached_blocks``: leading attention blocks this rank already holds (prefix cache), which
        ``block_ids`` leave out and prefill skips; ``num_tokens`` counts the tokens after them. A higher
        ``attempt`` (after preemption) replaces the pending one."""
        deadline = time.monotonic() + timeout_s
        self._put(
            _Receive(
                ExpectPush(
                    "", transfer_id, prefill, _tuple_blocks(block_ids), num_tokens, cached_blocks, attempt
                ),
                deadline,
            )
        )

    def read(
        self,
        transfer_id: str,
        prefill: PrefillCoordinates,
        remote_block_ids: BlockIds,
        block_ids: BlockIds,
        num_tokens: int,
        *,
        timeout_s: float,
    ) -> None:
        """Decode (pull): READ prefill's ``remote_block_ids`` into ``block_ids``; prefill is told when it may
        free."""
        deadline = time.monotonic() + timeout_s
        self._put(
            _Receive(
                ReadBlocks(
                    "",
                    transfer_id,
                    prefill,
                    _tuple_blocks(remote_block_ids),
                    _tuple_blocks(block_ids),
                    num_tokens,
                ),
                deadline,
            )
        )

    def add_peers(self, engine: EngineInfo) -> None:
        """Load a peer engine's agents (the side channel's announce), replacing a restarted engine's old
        ones."""
        self._put(_AddPeers(engine))

    def results(self) -> list[TransferResult]:
        """Transfers that ended since the last call (thread-safe, non-blocking)."""
        return self._context.take_results()

    def failing(self) -> list[TransferResult]:
        """Receives that failed since the last call while a peer may still write into their blocks
        (thread-safe, non-blocking): their requests may be answered now; each shows in :meth:`results` once no
        peer can."""
        return self._context.take_failing()

    def stats(self) -> dict[str, int]:
        """Event counters (registrations received, writes/reads posted, notifications refused, ...), for
        metrics and tests; with a staging buffer, ``staging_slots_free`` too."""
        stats = self._context.stats()
        if self._context.staging is not None:
            stats["staging_slots_free"] = self._context.staging.free_slots
        return stats

    def fenced(self) -> int:
        """Failed transfers whose blocks this rank still holds because a peer may touch them (as of the
        thread's last turn; any thread)."""
        return self._fenced

    def peer_agents(self) -> int:
        """Peer agents this rank's transport holds (as of the thread's last turn; any thread)."""
        return self._peer_agents

    def _put(self, command: _Command) -> None:
        if self._stop.is_set():
            raise RuntimeError("transfer worker is closed")
        self._inbox.put(command)

    def _wake(self) -> None:
        self._inbox.put(_Wake())

    # --- the thread -----------------------------------------------------------------------------------------

    def _run(self) -> None:
        transport: Transport | None = None
        doorbell: Doorbell | None = None
        try:
            if self._regions and self._regions[0].device is Device.VRAM:
                # before the agent exists: UCX binds to the thread's CUDA context
                bind_cuda_device(self._context.device_id)
            doorbell = Doorbell(
                self.config.host, self._wake, name=f"doorbell-{self.config.engine_id}-{self.layout.tp_rank}"
            )
            transport = self._transport_factory()
            staging = self._context.staging
            transport.register([*self._regions, *([staging.region] if staging is not None else [])])
            own = RankInfo(
                tp_rank=self.layout.tp_rank,
                agent_name=transport.name,
                agent_metadata=transport.metadata(),
                region_base_addresses=tuple(r.addr for r in self._regions),
                num_blocks=self.layout.num_blocks,
                device_id=self._context.device_id,
                doorbell_port=doorbell.port,
                placement=self.layout.placement,
                host=self.config.host,
            )
            self._context.bind(transport, own)
        except BaseException as error:
            if transport is not None:
                # A registration that failed half way must not leave the agent (and what it did register)
                # behind.
                with contextlib.suppress(TransportError):
                    transport.close()
            if doorbell is not None:
                doorbell.close()
            self._start_error = error
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(transport, doorbell)
        except BaseException:
            log.exception("transfer worker rank %d crashed", self.layout.tp_rank)
            raise
        finally:
            doorbell.close()
            self._context.close([*self._prefill.handles(), *self._decode.handles()])

    def _loop(self, transport: Transport, doorbell: Doorbell) -> None:
        delay = self.config.min_poll_s
        while not self._stop.is_set():
            try:
                progressed = self._drain_inbox(delay)
                if self._stop.is_set():
                    return
                doorbell.answered()  # this turn takes the notifications every ring so far announced
                now = time.monotonic()
                progressed |= self._on_notifications(self._take_notifications(transport), now)
                progressed |= self._context.retry_stranded()
                progressed |= self._prefill.poll(now)
                progressed |= self._decode.poll_reads(now)
                progressed |= self._decode.poll_handshakes(now)
                progressed |= self._decode.abandons.poll(now)
                progressed |= self._decode.poll_probes(now)
                progressed |= self._prefill.expire(now)
                progressed |= self._decode.expire(now)
                stuck = self._prefill.stuck_since() is not None or self._decode.stuck_since() is not None
                self._heartbeat.beat(now, healthy=not stuck)
                self._fenced, self._peer_agents = self._decode.fenced(), len(self._peers)
            except Exception:
                # A bug in one transfer's handling must not stop every other transfer's deadlines.
                log.exception("transfer worker rank %d: step failed", self.layout.tp_rank)
                progressed = False
            recent = time.monotonic() - max(doorbell.rung_at, self._context.sent_at) < MESSAGE_WINDOW_S
            delay = self._next_delay(delay, progressed, polling=recent)

    def _take_notifications(self, transport: Transport) -> list[tuple[str, bytes]]:
        try:
            return transport.take_notifications()
        except TransportError as error:
            log.warning(
                "transfer worker rank %d: polling notifications failed: %s", self.layout.tp_rank, error
            )
            return []

    def _drain_inbox(self, timeout: float) -> bool:
        try:
            command = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return False
        while True:
            self._execute(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _next_delay(self, delay: float, progressed: bool, *, polling: bool) -> float:
        if progressed:
            return self.config.min_poll_s
        polling |= self._prefill.busy or self._decode.busy
        delay = min(delay * 2, self.config.busy_poll_max_s) if polling else self.config.idle_poll_max_s
        deadlines = [
            d for d in (self._prefill.next_deadline(), self._decode.next_deadline()) if d is not None
        ]
        if deadlines:
            delay = min(delay, max(min(deadlines) - time.monotonic(), self.config.min_poll_s))
        return delay

    def _execute(self, command: _Command) -> None:
        now = time.monotonic()
        match command:
            case PrefillDone():
                self._prefill.prefill_done(command, now)
            case CancelTransfer(transfer_id=transfer_id, detail=detail):
                self._prefill.cancel(transfer_id, detail, now)
                self._decode.cancel(transfer_id, detail, now)
            case _Receive(command=AbandonTransfer() as abandoned, deadline=deadline):
                self._decode.abandons.abandon(abandoned, deadline)
            case _Receive(command=received, deadline=deadline, issued_at=issued_at):
                self._decode.begin(received, deadline, issued_at)
            case _AddPeers(engine=engine):
                try:
                    self._peers.load_engine(engine)
                except TransportError as error:
                    log.warning("cannot load the agents of announced engine %s: %s", engine.engine_id, error)
            case _Wake():
                pass

    def _on_notifications(self, notifications: list[tuple[str, bytes]], now: float) -> bool:
        for sender, frame in notifications:
            try:
                message = decode(frame)
            except ProtocolError as error:
                self._refuse(sender, frame, error)
                continue
            match message:
                case RegistrationMessage() | AbortMessage() | ReadDoneMessage():
                    self._prefill.on_message(message, now, sender=sender)
                case CompletionMessage() | FailureMessage():
                    self._decode.on_message(message, now)
        return bool(notifications)

    def _refuse(self, sender: str, frame: bytes, error: ProtocolError) -> None:
        log.warning("refused a notification from %s: %s", sender, error)
        self._context.count("notifications_refused")
        notice = rejection_notice(frame, error, rank=self.layout.tp_rank)
        if notice is not None:
            self._context.send(sender, notice)
