"""The transfer worker: one background thread per engine rank that owns the rank's transport.

Every agent call happens on this thread (agents are not thread-safe). The engine talks to it
only through non-blocking calls that enqueue a command, and drains :meth:`TransferWorker.results`
once per step, so an engine step never waits for the network. The thread turns commands and
incoming notifications into the protocol tables' inputs (:class:`RendezvousTable` on prefill,
:class:`CompletionTracker` on decode, :class:`PullHolds` for pull) with its own monotonic
clock, and their events into transport calls.

Roles (an engine uses one; nothing stops a rank doing both):

* prefill: :meth:`prefill_finished` (push: pair with registrations; pull: hold for READs),
  :meth:`cancel`; results of kind ``finished_sending`` mean "these blocks may be freed now".
* decode: :meth:`expect_push` (register with every writing prefill rank, count completions),
  :meth:`read` (pull: READ from every source rank, then tell prefill it may free);
  results ``finished_recving`` / ``failed_recving``.

Failure semantics: every wait has a deadline, every failure frees what it held and tells the
peer (a ``FailureMessage`` or an ``AbortMessage``) so nobody waits out a timeout when a prompt
answer is possible. Idle: the thread waits on its input queue with a timeout that grows from
``min_poll_s`` to ``busy_poll_max_s`` while anything is pending and to ``idle_poll_max_s`` when
nothing is (still bounded by the next deadline), so an idle worker costs next to no CPU.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from pdconnector.layout import LayerKind, RankLayout, plan_transfer, writers_for
from pdconnector.protocol.completion import CompletionTracker, TransferFailure
from pdconnector.protocol.messages import (
    MAX_DETAIL_CHARS,
    AbortMessage,
    CompletionMessage,
    FailureMessage,
    FailureReason,
    ProtocolError,
    ReadDoneMessage,
    RegistrationMessage,
    Side,
    decode,
    encode,
    rejection_notice,
)
from pdconnector.protocol.params import PrefillCoordinates
from pdconnector.protocol.rendezvous import (
    AbandonWrite,
    Closed,
    Event,
    NotifyDecode,
    PrefillBlocks,
    RendezvousLimits,
    RendezvousTable,
    StartWrite,
    WriteKey,
)
from pdconnector.transport.base import Device, MemoryRegion, TransferHandle, TransferState, TransferStatus, Transport, TransportError
from pdconnector.transport.cuda import bind_cuda_device
from pdconnector.worker.identity import EngineInfo, IncompatiblePeer, RankInfo, check_peer, fingerprint, layout_summary
from pdconnector.worker.pull import PullHolds, Released
from pdconnector.worker.side_channel import SideChannelClient

log = logging.getLogger(__name__)

BlockIds = Sequence[Sequence[int]]


class ResultKind(StrEnum):
    FINISHED_SENDING = "finished_sending"  # prefill: the blocks may be freed (whatever the outcome)
    FINISHED_RECVING = "finished_recving"  # decode: every byte landed
    FAILED_RECVING = "failed_recving"  # decode: the transfer will not complete; free / recompute


@dataclass(frozen=True)
class TransferResult:
    """One transfer's end on this rank, reported exactly once.

    ``outcome``: for sending, a :class:`Outcome` value (written/failed/expired/cancelled/rejected);
    for receiving, ``received`` or a :class:`FailureReason` value. ``nbytes``: bytes received.
    """

    transfer_id: str
    kind: ResultKind
    outcome: str
    detail: str
    nbytes: int = 0


@dataclass(frozen=True)
class WorkerConfig:
    engine_id: str
    host: str = "127.0.0.1"  # this engine's side-channel address, put into registrations
    side_channel_port: int = 5600
    limits: RendezvousLimits = field(default_factory=RendezvousLimits)
    pull_lease_s: float = 30.0
    min_poll_s: float = 1e-4
    busy_poll_max_s: float = 2e-3
    idle_poll_max_s: float = 0.05
    start_timeout_s: float = 60.0


# --- commands (engine thread -> worker thread) ---------------------------------------------------------------------


@dataclass(frozen=True)
class _PrefillFinished:
    blocks: PrefillBlocks
    pull: bool


@dataclass(frozen=True)
class _Cancel:
    transfer_id: str
    detail: str


@dataclass(frozen=True)
class _ExpectPush:
    transfer_id: str
    prefill: PrefillCoordinates
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    deadline: float
    attempt: int
    cached_blocks: int


@dataclass(frozen=True)
class _Read:
    transfer_id: str
    prefill: PrefillCoordinates
    remote_block_ids: tuple[tuple[int, ...], ...]
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    deadline: float


@dataclass(frozen=True)
class _AddPeers:
    engine: EngineInfo


@dataclass(frozen=True)
class _Wake:
    pass


_Command = _PrefillFinished | _Cancel | _ExpectPush | _Read | _AddPeers | _Wake


# --- decode-side state ----------------------------------------------------------------------------------------------


@dataclass
class _Handshaking:
    """A decode request waiting for the prefill engine's side-channel info."""

    request: _ExpectPush | _Read
    info: Future[EngineInfo]


@dataclass
class _PushWait:
    attempt: int
    writers: dict[int, str]  # prefill rank -> agent name, for aborts
    prefill: PrefillCoordinates


@dataclass
class _Reading:
    request: _Read
    handles: dict[int, TransferHandle]  # source prefill rank -> READ in flight
    agents: dict[int, str]
    nbytes: int = 0


def _tuple_blocks(blocks: BlockIds) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(b) for b in group) for group in blocks)


class TransferWorker:
    """One engine rank's transfers. Construct, :meth:`start`, call the role methods from any thread, drain :meth:`results`."""

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
            raise ValueError(f"layout has {len(layout.regions)} regions, {len(regions)} memory regions were given")
        for region, expected in zip(regions, layout.regions, strict=True):
            if region.nbytes < expected.nbytes:
                raise ValueError(f"memory region {expected.index} has {region.nbytes} bytes, the layout needs {expected.nbytes}")
        devices = {(r.device, r.device_id) for r in regions}
        if len(devices) > 1:
            raise ValueError(f"the memory regions of one rank must live on one device, got {sorted(f'{kind}:{index}' for kind, index in devices)}")
        self.layout = layout
        self.config = config
        self._regions = tuple(regions)
        self._region_addrs = np.array([r.addr for r in regions], dtype=np.int64)
        self._device_id = regions[0].device_id if regions else 0
        self._transport_factory = transport_factory
        self._side_channel = side_channel
        self._on_result = on_result
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[TransferResult] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._start_error: BaseException | None = None
        self._rank_info: RankInfo | None = None
        self._thread = threading.Thread(target=self._run, name=f"transfer-worker-{config.engine_id}-{layout.tp_rank}", daemon=True)
        self.layout_fingerprint = fingerprint(layout_summary(layout.model))
        # Everything below belongs to the worker thread.
        self._transport: Transport | None = None
        self._table = RendezvousTable(
            prefill_rank=layout.tp_rank,
            prefill_tp_size=layout.tp_size,
            block_size=layout.model.block_size,
            ssm_groups=frozenset(group.index for group in layout.groups if group.kind is LayerKind.SSM),
            limits=config.limits,
            layout_fingerprint=self.layout_fingerprint,
        )
        self._holds = PullHolds(prefill_rank=layout.tp_rank, prefill_tp_size=layout.tp_size, lease_s=config.pull_lease_s)
        self._writes: dict[WriteKey, TransferHandle] = {}
        self._tracker = CompletionTracker()
        self._handshaking: dict[str, _Handshaking] = {}
        self._pushes: dict[str, _PushWait] = {}
        self._reads: dict[str, _Reading] = {}
        self._peer_metadata: dict[str, bytes] = {}  # agent name -> metadata loaded into the transport
        self._engine_agents: dict[str, tuple[str, ...]] = {}  # engine id -> its agents we loaded
        self._stranded: list[TransferHandle] = []  # abandoned transfers the transport could not cancel yet
        self._counters: Counter[str] = Counter()
        self._counters_lock = threading.Lock()

    # --- lifecycle -------------------------------------------------------------------------------------------------

    def start(self) -> RankInfo:
        """Start the thread, create and register the transport on it; returns what the side channel serves for this rank."""
        self._thread.start()
        if not self._ready.wait(self.config.start_timeout_s):
            self._stop.set()
            raise TimeoutError(f"transfer worker rank {self.layout.tp_rank}: transport not ready within {self.config.start_timeout_s}s")
        if self._start_error is not None:
            raise RuntimeError(f"transfer worker rank {self.layout.tp_rank}: transport start failed: {self._start_error}") from self._start_error
        assert self._rank_info is not None
        return self._rank_info

    @property
    def rank_info(self) -> RankInfo:
        if self._rank_info is None:
            raise RuntimeError("transfer worker not started")
        return self._rank_info

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread, release transfers still in flight and close the transport."""
        self._stop.set()
        self._inbox.put(_Wake())
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # --- inputs (any thread, never block) --------------------------------------------------------------------------

    def prefill_finished(self, transfer_id: str, block_ids: BlockIds, num_tokens: int, *, pull: bool = False) -> None:
        """Prefill of ``transfer_id`` is done: hold ``block_ids`` (one list per KV group) until decode has them or a lease ends."""
        self._put(_PrefillFinished(PrefillBlocks(transfer_id, _tuple_blocks(block_ids), num_tokens), pull))

    def cancel(self, transfer_id: str, detail: str = "cancelled by the engine") -> None:
        """Give up on ``transfer_id`` (either role): free, tell the peer, report the end."""
        self._put(_Cancel(transfer_id, detail[:MAX_DETAIL_CHARS]))

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
        """Decode (push): register ``block_ids`` with every prefill rank writing this rank and wait for their completions.

        ``cached_blocks``: leading attention blocks this rank already holds (prefix cache), which ``block_ids``
        leave out and prefill skips; ``num_tokens`` counts the tokens after them. A higher ``attempt``
        (after preemption) replaces the pending one."""
        deadline = time.monotonic() + timeout_s
        self._put(_ExpectPush(transfer_id, prefill, _tuple_blocks(block_ids), num_tokens, deadline, attempt, cached_blocks))

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
        """Decode (pull): READ prefill's ``remote_block_ids`` into ``block_ids``; prefill is told when it may free."""
        self._put(_Read(transfer_id, prefill, _tuple_blocks(remote_block_ids), _tuple_blocks(block_ids), num_tokens, time.monotonic() + timeout_s))

    def add_peers(self, engine: EngineInfo) -> None:
        """Load a peer engine's agents (the side channel's announce), replacing a restarted engine's old ones."""
        self._put(_AddPeers(engine))

    def results(self) -> list[TransferResult]:
        """Transfers that ended since the last call (thread-safe, non-blocking)."""
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def stats(self) -> dict[str, int]:
        """Event counters (registrations received, writes/reads posted, notifications refused, ...), for metrics and tests."""
        with self._counters_lock:
            return dict(self._counters)

    def _count(self, name: str, n: int = 1) -> None:
        with self._counters_lock:
            self._counters[name] += n

    def _put(self, command: _Command) -> None:
        if self._stop.is_set():
            raise RuntimeError("transfer worker is closed")
        self._inbox.put(command)

    # --- the thread ------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._regions and self._regions[0].device is Device.VRAM:
                bind_cuda_device(self._device_id)  # before the agent exists: UCX binds to the thread's CUDA context
            transport = self._transport_factory()
            transport.register(self._regions)
            self._transport = transport
            self._rank_info = RankInfo(
                tp_rank=self.layout.tp_rank,
                agent_name=transport.name,
                agent_metadata=transport.metadata(),
                region_base_addresses=tuple(r.addr for r in self._regions),
                num_blocks=self.layout.num_blocks,
                device_id=self._device_id,
            )
        except BaseException as error:
            self._start_error = error
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(transport)
        except BaseException:
            log.exception("transfer worker rank %d crashed", self.layout.tp_rank)
            raise
        finally:
            self._shutdown(transport)

    def _loop(self, transport: Transport) -> None:
        delay = self.config.min_poll_s
        while not self._stop.is_set():
            try:
                progressed = self._drain_inbox(delay)
                if self._stop.is_set():
                    return
                now = time.monotonic()
                progressed |= self._on_notifications(self._take_notifications(transport), now)
                progressed |= self._poll_transfers(now)
                progressed |= self._poll_handshakes(now)
                progressed |= self._expire(now)
            except Exception:
                # A bug in one transfer's handling must not stop every other transfer's deadlines.
                log.exception("transfer worker rank %d: step failed", self.layout.tp_rank)
                progressed = False
            delay = self._next_delay(delay, progressed)

    def _take_notifications(self, transport: Transport) -> list[tuple[str, bytes]]:
        try:
            return transport.take_notifications()
        except TransportError as error:
            log.warning("transfer worker rank %d: polling notifications failed: %s", self.layout.tp_rank, error)
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

    def _next_delay(self, delay: float, progressed: bool) -> float:
        if progressed:
            return self.config.min_poll_s
        busy = self._writes or self._reads or self._handshaking or self._pushes or self._tracker or self._table or self._holds
        delay = min(delay * 2, self.config.busy_poll_max_s if busy else self.config.idle_poll_max_s)
        deadlines = [d for d in (self._table.next_deadline(), self._tracker.next_deadline(), self._holds.next_deadline()) if d is not None]
        if deadlines:
            delay = min(delay, max(min(deadlines) - time.monotonic(), self.config.min_poll_s))
        return delay

    def _execute(self, command: _Command) -> None:
        now = time.monotonic()
        match command:
            case _PrefillFinished(blocks=blocks, pull=True):
                self._count("prefills_finished")
                try:
                    self._report_released(self._holds.hold(blocks, now))
                except ValueError as error:
                    log.error("transfer %s: %s", blocks.transfer_id, error)
            case _PrefillFinished(blocks=blocks):
                self._count("prefills_finished")
                try:
                    self._apply(self._table.prefill_finished(blocks.transfer_id, blocks.block_ids, blocks.num_tokens, now), now)
                except ValueError as error:
                    log.error("transfer %s: %s", blocks.transfer_id, error)
            case _Cancel(transfer_id=transfer_id, detail=detail):
                self._cancel(transfer_id, detail, now)
            case _ExpectPush() | _Read():
                self._begin_decode(command)
            case _AddPeers(engine=engine):
                try:
                    self._load_engine(engine)
                except TransportError as error:
                    log.warning("cannot load the agents of announced engine %s: %s", engine.engine_id, error)
            case _Wake():
                pass

    # --- prefill: rendezvous events -> transport ---------------------------------------------------------------------

    def _apply(self, events: list[Event], now: float) -> None:
        pending = list(events)
        while pending:
            event = pending.pop(0)
            match event:
                case StartWrite():
                    pending += self._start_write(event, now)
                case AbandonWrite(key=key):
                    handle = self._writes.pop(key, None)
                    if handle is not None:
                        self._release(handle)
                case NotifyDecode(destination=destination, message=message):
                    self._send(destination.agent_name, message)
                case Closed(transfer_id=transfer_id, outcome=outcome, detail=detail, blocks=blocks):
                    if blocks is not None:
                        self._report(TransferResult(transfer_id, ResultKind.FINISHED_SENDING, outcome.value, detail))

    def _start_write(self, event: StartWrite, now: float) -> list[Event]:
        registration, key = event.registration, event.key
        try:
            if registration.agent_metadata:
                self._load_peer(registration.agent_metadata)
            if registration.agent_name not in self._peer_metadata:
                raise TransportError(f"decode agent {registration.agent_name!r} is unknown (no metadata in the registration or the handshake)")
            destination = RankLayout(self.layout.model, registration.decode_tp_size, registration.decode_tp_rank, registration.num_blocks)
            if len(registration.region_base_addresses) != len(destination.regions):
                count = len(registration.region_base_addresses)
                raise ValueError(f"registration has {count} region addresses, the layout has {len(destination.regions)}")
            plan = plan_transfer(self.layout, destination, event.prefill.block_ids, registration.block_ids, num_tokens=event.prefill.num_tokens)
            local, remote = plan.to_descriptors(
                self._region_addrs, registration.region_base_addresses, src_device_id=self._device_id, dst_device_id=registration.device_id
            )
            notification = encode(
                CompletionMessage(
                    transfer_id=key.transfer_id,
                    attempt=key.attempt,
                    prefill_rank=self.layout.tp_rank,
                    prefill_tp_size=self.layout.tp_size,
                    bytes_written=plan.nbytes,
                )
            )
            assert self._transport is not None
            self._writes[key] = self._transport.write(registration.agent_name, local, remote, notification)
            self._count("writes_posted")
        except (ValueError, TransportError) as error:
            return self._table.write_failed(key, f"cannot post WRITE: {error}", now)
        return []

    # --- decode: handshake, registration, reads ---------------------------------------------------------------------

    def _begin_decode(self, request: _ExpectPush | _Read) -> None:
        transfer_id = request.transfer_id
        if transfer_id in self._reads or (isinstance(request, _Read) and (transfer_id in self._handshaking or transfer_id in self._pushes)):
            self._fail_recv(transfer_id, FailureReason.INVALID_REGISTRATION, f"transfer {transfer_id} is already being received")
            return
        if self._side_channel is None:
            self._fail_recv(transfer_id, FailureReason.INCOMPATIBLE, "this worker has no side-channel client (decode role needs one)")
            return
        future = self._side_channel.lookup(request.prefill)
        future.add_done_callback(lambda _: self._inbox.put(_Wake()))
        self._handshaking[transfer_id] = _Handshaking(request, future)

    def _poll_handshakes(self, now: float) -> bool:
        progressed = False
        for transfer_id, waiting in list(self._handshaking.items()):
            request = waiting.request
            if not waiting.info.done():
                if request.deadline <= now:
                    del self._handshaking[transfer_id]
                    address = f"{request.prefill.host}:{request.prefill.side_channel_port}"
                    self._fail_recv(transfer_id, FailureReason.TIMEOUT, f"no side-channel answer from {address} by the deadline")
                    progressed = True
                continue
            del self._handshaking[transfer_id]
            progressed = True
            try:
                engine = waiting.info.result()
                check_peer(self.layout, engine, peer_is_prefill=True)
                self._load_engine(engine)
            except IncompatiblePeer as error:
                self._fail_recv(transfer_id, FailureReason.INCOMPATIBLE, str(error))
                continue
            except (ConnectionError, OSError, ValueError, TransportError) as error:
                assert self._side_channel is not None
                self._side_channel.invalidate(request.prefill)
                self._fail_recv(transfer_id, FailureReason.INCOMPATIBLE, f"handshake with {request.prefill.engine_id} failed: {error}")
                continue
            if isinstance(request, _ExpectPush):
                self._register(request, engine)
            else:
                self._post_reads(request, engine)
        return progressed

    def _register(self, request: _ExpectPush, engine: EngineInfo) -> None:
        rank, d_tp, p_tp = self.layout.tp_rank, self.layout.tp_size, engine.tp_size
        writers = {p: engine.ranks[p].agent_name for p in writers_for(rank, p_tp, d_tp)}
        previous = self._pushes.get(request.transfer_id)
        if previous is not None and request.attempt <= previous.attempt:
            log.warning("transfer %s: attempt %d ignored, attempt %d is pending", request.transfer_id, request.attempt, previous.attempt)
            return
        try:
            self._tracker.expect(request.transfer_id, request.attempt, writers, request.deadline)
        except ValueError as error:
            self._fail_recv(request.transfer_id, FailureReason.CAPACITY, str(error))
            return
        self._pushes[request.transfer_id] = _PushWait(request.attempt, writers, request.prefill)
        assert self._rank_info is not None
        try:
            message = RegistrationMessage(
                transfer_id=request.transfer_id,
                attempt=request.attempt,
                decode_engine_id=self.config.engine_id,
                decode_host=self.config.host,
                decode_port=self.config.side_channel_port,
                decode_tp_rank=rank,
                decode_tp_size=d_tp,
                num_tokens=request.num_tokens,
                num_blocks=self.layout.num_blocks,
                block_ids=request.block_ids,
                agent_name=self._rank_info.agent_name,
                agent_metadata=self._rank_info.agent_metadata,
                region_base_addresses=self._rank_info.region_base_addresses,
                layout_fingerprint=self.layout_fingerprint,
                cached_blocks=request.cached_blocks,
                device_id=self._device_id,
            )
            frame = encode(message)
        except (ProtocolError, ValueError) as error:
            self._tracker.cancel(request.transfer_id)
            self._end_push(request.transfer_id, abort=False)
            self._fail_recv(request.transfer_id, FailureReason.INVALID_REGISTRATION, str(error))
            return
        self._count("registrations_sent", len(writers))
        for agent in writers.values():
            if not self._send_frame(agent, frame):
                self._tracker.cancel(request.transfer_id)
                self._end_push(request.transfer_id, abort=True, detail="registration could not be delivered")
                self._fail_recv(request.transfer_id, FailureReason.WRITE_FAILED, f"could not send the registration to prefill agent {agent}")
                return

    def _post_reads(self, request: _Read, engine: EngineInfo) -> None:
        rank, d_tp = self.layout.tp_rank, self.layout.tp_size
        reading = _Reading(request, {}, {})
        self._reads[request.transfer_id] = reading
        assert self._transport is not None
        sources = writers_for(rank, engine.tp_size, d_tp)
        # Every source rank holds the blocks for this READ: all of them are told if it fails, posted or not.
        reading.agents.update({p: engine.ranks[p].agent_name for p in sources})
        try:
            for p in sources:
                source = engine.rank_layout(self.layout.model, p)
                plan = plan_transfer(source, self.layout, request.remote_block_ids, request.block_ids, num_tokens=request.num_tokens)
                remote, local = plan.to_descriptors(
                    engine.ranks[p].region_base_addresses, self._region_addrs, src_device_id=engine.ranks[p].device_id, dst_device_id=self._device_id
                )
                done = ReadDoneMessage(transfer_id=request.transfer_id, attempt=0, decode_rank=rank, decode_tp_size=d_tp, bytes_read=plan.nbytes)
                reading.handles[p] = self._transport.read(engine.ranks[p].agent_name, local, remote, encode(done))
                self._count("reads_posted")
                reading.nbytes += plan.nbytes
        except (ValueError, TransportError) as error:
            self._end_read(request.transfer_id, FailureReason.WRITE_FAILED, f"cannot post READ: {error}")

    def _end_read(self, transfer_id: str, reason: FailureReason | None, detail: str) -> None:
        """Finish a pull on this rank: release handles; on failure tell every source rank to free and report."""
        reading = self._reads.pop(transfer_id)
        for handle in reading.handles.values():
            self._release(handle)
        if reason is None:
            self._report(TransferResult(transfer_id, ResultKind.FINISHED_RECVING, "received", detail, reading.nbytes))
            return
        if self._side_channel is not None:
            self._side_channel.invalidate(reading.request.prefill)
        abort = AbortMessage(transfer_id=transfer_id, attempt=0, decode_rank=self.layout.tp_rank, detail=detail[:MAX_DETAIL_CHARS])
        for agent in reading.agents.values():
            self._send(agent, abort)
        self._fail_recv(transfer_id, reason, detail)

    def _end_push(self, transfer_id: str, *, abort: bool, detail: str = "") -> None:
        """Forget a push this rank waited for; ``abort``: it failed on this side, so tell the writers to free and
        re-handshake next time (the peer may have restarted under the same coordinates)."""
        waiting = self._pushes.pop(transfer_id, None)
        if waiting is None or not abort:
            return
        if self._side_channel is not None:
            self._side_channel.invalidate(waiting.prefill)
        message = AbortMessage(transfer_id=transfer_id, attempt=waiting.attempt, decode_rank=self.layout.tp_rank, detail=detail[:MAX_DETAIL_CHARS])
        for agent in waiting.writers.values():
            self._send(agent, message)

    # --- both: cancel, notifications, polling, deadlines ----------------------------------------------------------

    def _cancel(self, transfer_id: str, detail: str, now: float) -> None:
        self._apply(self._table.cancel(transfer_id, detail, now), now)
        self._report_released(self._holds.cancel(transfer_id, detail))
        if self._handshaking.pop(transfer_id, None) is not None:
            self._fail_recv(transfer_id, FailureReason.CANCELLED, detail)
        if self._tracker.cancel(transfer_id) is not None:
            self._end_push(transfer_id, abort=True, detail=detail)
            self._fail_recv(transfer_id, FailureReason.CANCELLED, detail)
        if transfer_id in self._reads:
            self._end_read(transfer_id, FailureReason.CANCELLED, detail)

    def _on_notifications(self, notifications: list[tuple[str, bytes]], now: float) -> bool:
        for sender, frame in notifications:
            try:
                message = decode(frame)
            except ProtocolError as error:
                self._refuse(sender, frame, error)
                continue
            match message:
                case RegistrationMessage():
                    self._count("registrations_received")
                    if message.agent_metadata:
                        try:
                            self._load_peer(message.agent_metadata)
                        except TransportError as error:
                            log.warning("registration of %s: cannot load decode agent %s: %s", message.transfer_id, message.agent_name, error)
                    self._apply(self._table.registration_received(message, now), now)
                case AbortMessage() if message.transfer_id in self._holds:
                    self._report_released(self._holds.notice_received(message, now))
                case AbortMessage():
                    # Unknown to both tables, it may be a pull abort overtaking its hold: the holds keep it for a lease.
                    self._apply(self._table.abort_received(message, now), now)
                    self._holds.notice_received(message, now)
                case ReadDoneMessage():
                    self._report_released(self._holds.notice_received(message, now))
                case CompletionMessage() | FailureMessage():
                    self._tracker.on_message(message)
        return bool(notifications)

    def _report_released(self, released: Released | None) -> None:
        if released is not None:
            self._report(TransferResult(released.transfer_id, ResultKind.FINISHED_SENDING, released.outcome.value, released.detail))

    def _refuse(self, sender: str, frame: bytes, error: ProtocolError) -> None:
        log.warning("refused a notification from %s: %s", sender, error)
        self._count("notifications_refused")
        notice = rejection_notice(frame, error, rank=self.layout.tp_rank)
        if notice is not None:
            self._send(sender, notice)

    def _poll_transfers(self, now: float) -> bool:
        assert self._transport is not None
        progressed = self._retry_stranded()
        for key, handle in list(self._writes.items()):
            status = self._state(handle)
            if not status.finished:
                continue
            del self._writes[key]
            self._release(handle)
            progressed = True
            if status.state is TransferState.DONE:
                self._apply(self._table.write_done(key, now), now)
            else:
                self._apply(self._table.write_failed(key, f"WRITE failed: {status.error}", now), now)
        for transfer_id, reading in list(self._reads.items()):
            failed = None
            for p, handle in list(reading.handles.items()):
                status = self._state(handle)
                if status.state is TransferState.DONE:
                    del reading.handles[p]
                    self._release(handle)
                elif status.state is TransferState.FAILED:
                    failed = f"READ from prefill rank {p} failed: {status.error}"
                    break
            if failed is not None:
                progressed = True
                self._end_read(transfer_id, FailureReason.WRITE_FAILED, failed)
            elif not reading.handles:
                progressed = True
                self._end_read(transfer_id, None, f"read from prefill ranks {sorted(reading.agents)}")
        return progressed

    def _expire(self, now: float) -> bool:
        progressed = False
        deadline = self._table.next_deadline()
        if deadline is not None and deadline <= now:
            events = self._table.expire(now)
            self._apply(events, now)
            progressed |= bool(events)
        for released in self._holds.expire(now):
            self._report_released(released)
            progressed = True
        for transfer_id, reading in list(self._reads.items()):
            if reading.request.deadline <= now:
                self._end_read(transfer_id, FailureReason.TIMEOUT, f"READ not done by the deadline (pending prefill ranks {sorted(reading.handles)})")
                progressed = True
        polled = self._tracker.poll(now)
        for received in polled.finished:
            self._pushes.pop(received.transfer_id, None)
            detail = f"attempt {received.attempt} received"
            self._report(TransferResult(received.transfer_id, ResultKind.FINISHED_RECVING, "received", detail, received.bytes_written))
        for failure in polled.failed:
            self._end_push(failure.transfer_id, abort=failure.side is Side.DECODE, detail=failure.detail)
            self._report_failure(failure)
        return progressed or bool(polled.finished or polled.failed)

    def _report_failure(self, failure: TransferFailure) -> None:
        detail = f"{failure.side} gave up on attempt {failure.attempt}: {failure.detail}"
        self._report(TransferResult(failure.transfer_id, ResultKind.FAILED_RECVING, failure.reason.value, detail))

    # --- transport helpers ------------------------------------------------------------------------------------------

    def _load_engine(self, engine: EngineInfo) -> None:
        """Load an engine's agents; drop the agents an earlier incarnation of the same engine id had."""
        names = tuple(self._load_peer(rank.agent_metadata) for rank in engine.ranks)
        stale = set(self._engine_agents.get(engine.engine_id, ())) - set(names)
        for name in stale:
            self._forget_peer(name)
            self._count("peers_dropped")
        self._engine_agents[engine.engine_id] = names

    def _load_peer(self, metadata: bytes) -> str:
        assert self._transport is not None
        name = self._transport.add_peer(metadata) if metadata not in self._peer_metadata.values() else None
        if name is None:
            return next(agent for agent, loaded in self._peer_metadata.items() if loaded == metadata)
        self._peer_metadata[name] = metadata
        return name

    def _forget_peer(self, name: str) -> None:
        assert self._transport is not None
        self._peer_metadata.pop(name, None)
        try:
            self._transport.remove_peer(name)
        except TransportError as error:
            log.info("removing stale peer %s: %s", name, error)

    def _send(self, agent: str, message: FailureMessage | AbortMessage) -> bool:
        return self._send_frame(agent, encode(message))

    def _send_frame(self, agent: str, frame: bytes) -> bool:
        assert self._transport is not None
        try:
            self._transport.notify(agent, frame)
        except TransportError as error:
            log.warning("notification to %s not sent: %s", agent, error)
            return False
        return True

    def _state(self, handle: TransferHandle) -> TransferStatus:
        assert self._transport is not None
        try:
            return self._transport.state(handle)
        except TransportError as error:
            return TransferStatus(TransferState.FAILED, f"polling failed: {error}")

    def _release(self, handle: TransferHandle) -> None:
        assert self._transport is not None
        try:
            self._transport.release(handle)
        except TransportError as error:
            log.info("transfer %s not released yet (%s); will retry", handle.id, error)
            self._stranded.append(handle)

    def _retry_stranded(self) -> bool:
        if not self._stranded:
            return False
        stranded, self._stranded = self._stranded, []
        for handle in stranded:
            self._release(handle)
        return len(self._stranded) < len(stranded)

    def _fail_recv(self, transfer_id: str, reason: FailureReason, detail: str) -> None:
        self._report(TransferResult(transfer_id, ResultKind.FAILED_RECVING, reason.value, detail))

    def _report(self, result: TransferResult) -> None:
        self._count(result.kind.value)
        self._results.put(result)
        if self._on_result is not None:
            self._on_result()

    def _shutdown(self, transport: Transport) -> None:
        for handle in [*self._writes.values(), *(h for r in self._reads.values() for h in r.handles.values()), *self._stranded]:
            try:
                transport.release(handle)
            except TransportError as error:
                log.info("closing with transfer %s still in flight: %s", handle.id, error)
        try:
            transport.close()
        except TransportError as error:
            log.warning("closing transport %s: %s", transport.name, error)
