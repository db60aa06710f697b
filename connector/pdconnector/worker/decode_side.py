"""The decode side of a rank's transfer worker: handshake, then register (push) or READ (pull), then count the
end.

Every decode command starts with a side-channel lookup of the prefill engine (answered from the client's cache
after the first). Push: the registration goes to every prefill rank that writes this rank and the
:class:`CompletionTracker` counts their completion notifications. Pull: this rank READs from every source
rank, each READ's notification telling that rank it may free. Either way the end is reported once, as
``finished_recving`` or ``failed_recving``; a failure on this side tells the prefill ranks (an
``AbortMessage``) and invalidates the cached handshake, since the peer may have restarted under the same
coordinates. A failure is reported (and the engine frees the blocks) only once nothing can land in them any
more: push waits for every writer's answer or the fence (:mod:`pdconnector.protocol.completion`); pull waits
until its own READs ended or were cancelled, and only then tells prefill to free its side. Each command comes
with its deadline, taken on the worker's clock when the worker received it. Inputs come from the worker
thread's loop with its clock ``now``; this side shares nothing with the prefill side but the
:class:`WorkerContext` and the :class:`PeerRegistry`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pdconnector.layout import plan_transfer, writers_for
from pdconnector.protocol.completion import AbortWriters, CompletionTracker, TransferFailure
from pdconnector.protocol.liveness import REGISTRATION_GRACE_S
from pdconnector.protocol.messages import (
    MAX_DETAIL_CHARS,
    AbortMessage,
    CompletionMessage,
    FailureMessage,
    FailureReason,
    ProtocolError,
    ReadDoneMessage,
    RegistrationMessage,
    encode,
    registration_frame,
)
from pdconnector.protocol.rendezvous import Outcome
from pdconnector.protocol.timeline import Milestone, Timeline
from pdconnector.transport.base import PeerUnreachable, TransferHandle, TransferState, TransportError
from pdconnector.worker.commands import ExpectPush, ReadBlocks
from pdconnector.worker.context import ResultKind, TransferResult, WorkerContext
from pdconnector.worker.decode_abandons import Abandons
from pdconnector.worker.decode_transfers import (
    Handshaking,
    PushWait,
    Reading,
    failure_detail,
    received_stages,
)
from pdconnector.worker.identity import EngineInfo, IncompatiblePeer, check_peer
from pdconnector.worker.peers import PeerRegistry
from pdconnector.worker.side_channel import PeerGone, SideChannelClient
from pdconnector.worker.staging import offer_slot, scatter_staged

log = logging.getLogger(__name__)


class DecodeSide:
    """Args:
    side_channel: looks prefill engines up; without one every decode command fails at once.
    wake: wakes the worker thread (a handshake answered from another thread).
    engine_id, host, side_channel_port: this engine as its registrations name it.
    """

    def __init__(
        self,
        context: WorkerContext,
        peers: PeerRegistry,
        *,
        side_channel: SideChannelClient | None,
        wake: Callable[[], None],
        engine_id: str,
        host: str,
        side_channel_port: int,
        fence_s: float,
        gone_grace_s: float = 1.0,
        probe_interval_s: float = 2.0,
    ) -> None:
        self.layout = context.layout
        self._context = context
        self._peers = peers
        self._side_channel = side_channel
        self._wake = wake
        self._engine_id = engine_id
        self._host = host
        self._side_channel_port = side_channel_port
        self._tracker = CompletionTracker(fence_s=fence_s)
        self._gone_grace_s = gone_grace_s
        self._probe_interval_s = probe_interval_s
        self._handshaking: dict[str, Handshaking] = {}
        # requests that ended before they registered: prefill is told, nothing waits on it
        self.abandons = Abandons(context, peers, side_channel, wake)
        self._pushes: dict[str, PushWait] = {}
        self._reads: dict[str, Reading] = {}
        self._failed_reads = (
            0  # reads failed and waiting for their READs to end or be cancelled (``ending`` set)
        )
        self._stuck: dict[str, float] = {}  # failed reads with a READ that could not be cancelled: since when

    @property
    def busy(self) -> bool:
        """Whether a transfer may be moving: a READ in flight ends only in the transport's state, and a
        registered push may be written into at any moment, which can need this agent to progress (UCX over TCP
        emulates RDMA with messages both sides handle). Handshakes, probes and abandons wake the thread when
        answered."""
        return bool(self._reads or self._pushes or self._tracker)

    def next_deadline(self) -> float | None:
        return self._tracker.next_deadline()

    def fenced(self) -> int:
        """Failed transfers whose blocks are still held because a peer may still touch them."""
        return self._tracker.fenced() + self._failed_reads

    def stuck_since(self) -> float | None:
        """When the oldest READ that could not be cancelled was given up (None: there is none)."""
        return min(self._stuck.values(), default=None)

    def handles(self) -> list[TransferHandle]:
        """The READs in flight (for shutdown)."""
        return [handle for reading in self._reads.values() for handle in reading.handles.values()]

    # --- inputs ---------------------------------------------------------------------------------------------

    def begin(self, command: ExpectPush | ReadBlocks, deadline: float, issued_at: float) -> None:
        """Start receiving (asked for by the engine at ``issued_at``): look the prefill engine up;
        registration or READs follow when it answers."""
        transfer_id = command.transfer_id
        if transfer_id in self._reads or (
            isinstance(command, ReadBlocks)
            and (transfer_id in self._handshaking or transfer_id in self._pushes)
        ):
            self._fail(
                transfer_id,
                FailureReason.INVALID_REGISTRATION,
                f"transfer {transfer_id} is already being received",
            )
            return
        if self._side_channel is None:
            self._fail(
                transfer_id,
                FailureReason.INCOMPATIBLE,
                "this worker has no side-channel client (decode role needs one)",
            )
            return
        timeline = Timeline()
        timeline.mark(Milestone.REQUESTED, issued_at)
        self._lookup(command, deadline, timeline)

    def _lookup(
        self, command: ExpectPush | ReadBlocks, deadline: float, timeline: Timeline, *, again: bool = False
    ) -> None:
        assert self._side_channel is not None
        future = self._side_channel.lookup(command.prefill)
        future.add_done_callback(lambda _: self._wake())
        self._handshaking[command.transfer_id] = Handshaking(command, deadline, future, timeline, again)

    def poll_probes(self, now: float) -> bool:
        """Fenced pushes whose prefill engine turned out gone (refused, or another incarnation answers) end
        their fence after the grace: a dead process posts nothing."""
        progressed = False
        for transfer_id, waiting in self._pushes.items():
            if self._side_channel is None or not self._tracker.is_fenced(transfer_id):
                continue
            if waiting.probe is None:
                if now >= waiting.next_probe:
                    waiting.probe = self._side_channel.probe(waiting.prefill)
                    waiting.probe.add_done_callback(lambda _: self._wake())
                continue
            if not waiting.probe.done():
                continue
            probe, waiting.probe = waiting.probe, None
            waiting.next_probe = now + self._probe_interval_s
            error = probe.exception()
            if isinstance(error, PeerGone):
                gone = True
            elif error is None:
                gone = not set(waiting.writers.values()) & {rank.agent_name for rank in probe.result().ranks}
            else:
                gone = False  # unreachable or slow: maybe frozen, the fence decides
            if gone and self._tracker.writers_gone(transfer_id, now, grace_s=self._gone_grace_s):
                engine_id = waiting.prefill.engine_id
                log.info(
                    "transfer %s: prefill %s is gone; its blocks are released after %.1fs",
                    transfer_id,
                    engine_id,
                    self._gone_grace_s,
                )
                progressed = True
        return progressed

    def cancel(self, transfer_id: str, detail: str, now: float) -> None:
        """The request ended: nothing registered yet ends now; a registered push or posted pull ends once
        fenced."""
        if self._handshaking.pop(transfer_id, None) is not None:
            self._fail(transfer_id, FailureReason.CANCELLED, detail)
        self._tracker.cancel(transfer_id, FailureReason.CANCELLED, detail, now)
        if transfer_id in self._reads:
            self._end_read(transfer_id, FailureReason.CANCELLED, detail, now)

    def on_message(self, message: CompletionMessage | FailureMessage, now: float) -> None:
        """A notification meant for decode (a prefill rank's completion or failure); a staged share is
        scattered into the blocks before its completion counts."""
        if isinstance(message, CompletionMessage) and message.staged:
            waiting = self._pushes.get(message.transfer_id)
            if waiting is None or waiting.attempt != message.attempt:
                return  # stale: its attempt was replaced or ended, and nothing of it is scattered
            try:
                scatter_staged(self._context.staging, message, waiting.staged)
            except (ValueError, RuntimeError) as error:
                detail = f"staged share not scattered: {error}"
                self._tracker.cancel(message.transfer_id, FailureReason.WRITE_FAILED, detail, now)
        self._tracker.on_message(message, now)

    def poll_handshakes(self, now: float) -> bool:
        progressed = False
        for transfer_id, waiting in list(self._handshaking.items()):
            command = waiting.command
            if not waiting.info.done():
                if waiting.deadline <= now:
                    del self._handshaking[transfer_id]
                    address = f"{command.prefill.host}:{command.prefill.side_channel_port}"
                    self._fail(
                        transfer_id,
                        FailureReason.TIMEOUT,
                        f"no side-channel answer from {address} by the deadline",
                    )
                    progressed = True
                continue
            del self._handshaking[transfer_id]
            progressed = True
            try:
                engine = waiting.info.result()
                check_peer(self.layout, engine, peer_is_prefill=True)
                self._peers.load_engine(engine, host=command.prefill.host)
            except IncompatiblePeer as error:
                self._fail(transfer_id, FailureReason.INCOMPATIBLE, str(error))
                continue
            except (ConnectionError, OSError, ValueError, TransportError) as error:
                self._handshake_failed(waiting, error, now)
                continue
            waiting.timeline.mark(Milestone.HANDSHAKEN, now)
            if isinstance(command, ExpectPush):
                self._register(command, waiting, engine, now)
            else:
                self._post_reads(command, waiting.deadline, engine, waiting.timeline, now)
        return progressed

    def poll_reads(self, now: float) -> bool:
        """Collect the READs that ended; a pull ends when all its READs did, or at the first failure."""
        progressed = False
        for transfer_id, reading in list(self._reads.items()):
            failed = None
            for p, handle in list(reading.handles.items()):
                status = self._context.state(handle)
                if status.finished:
                    del reading.handles[p]
                    self._context.release(handle)
                    # the READ's notification tells that prefill rank it may free
                    self._context.ring(handle.peer)
                    progressed = True
                if status.state is TransferState.FAILED and failed is None:
                    failed = f"READ from prefill rank {p} failed: {status.error}"
            if reading.ending is not None:
                if not reading.handles:
                    self._close_failed_read(transfer_id)
            elif failed is not None:
                self._end_read(transfer_id, FailureReason.WRITE_FAILED, failed, now)
            elif not reading.handles and reading.deadline <= now:
                # Done, but maybe after prefill's hold ended (the deadline is bounded by it): the bytes may be
                # another request's.
                self._end_read(
                    transfer_id,
                    FailureReason.TIMEOUT,
                    "READ completed after its deadline; its bytes are not used",
                    now,
                )
            elif not reading.handles:
                progressed = True
                self._end_read(transfer_id, None, f"read from prefill ranks {sorted(reading.agents)}", now)
        return progressed

    def expire(self, now: float) -> bool:
        progressed = False
        for transfer_id, reading in list(self._reads.items()):
            if reading.deadline <= now and reading.ending is None:
                detail = f"READ not done by the deadline (pending prefill ranks {sorted(reading.handles)})"
                self._end_read(transfer_id, FailureReason.TIMEOUT, detail, now)
                progressed = True
        polled = self._tracker.poll(now)
        for abort in polled.aborts:
            self._abort_writers(abort)
        for failure in polled.failing:
            if failure.reason is not FailureReason.CANCELLED:  # cancelled: its request is over already
                self._context.announce_failing(
                    TransferResult(
                        failure.transfer_id,
                        ResultKind.FAILED_RECVING,
                        failure.reason,
                        failure_detail(failure),
                    )
                )
        for received in polled.finished:
            self._context.give_back_slot(received.transfer_id)
            stages = received_stages(self._pushes.pop(received.transfer_id, None), now)
            detail = f"attempt {received.attempt} received"
            result = TransferResult(
                received.transfer_id,
                ResultKind.FINISHED_RECVING,
                Outcome.RECEIVED,
                detail,
                received.bytes_written,
                stages,
            )
            self._context.report(result)
        for failure in polled.failed:
            self._context.give_back_slot(failure.transfer_id)
            self._pushes.pop(failure.transfer_id, None)
            if failure.unconfirmed:
                self._context.count("fences_expired")
                unconfirmed = list(failure.unconfirmed)
                log.warning(
                    "transfer %s: prefill ranks %s never answered; blocks released after the fence",
                    failure.transfer_id,
                    unconfirmed,
                )
            self._report_failure(failure)
        return progressed or bool(polled.finished or polled.failed or polled.aborts or polled.failing)

    # --- push: registration ---------------------------------------------------------------------------------

    def _register(self, command: ExpectPush, handshake: Handshaking, engine: EngineInfo, now: float) -> None:
        deadline, timeline = handshake.deadline, handshake.timeline
        rank, d_tp, p_tp = self.layout.tp_rank, self.layout.tp_size, engine.tp_size
        writers = {p: engine.ranks[p].agent_name for p in writers_for(rank, p_tp, d_tp)}
        previous = self._pushes.get(command.transfer_id)
        if previous is not None and command.attempt <= previous.attempt:
            log.warning(
                "transfer %s: attempt %d ignored, attempt %d is pending",
                command.transfer_id,
                command.attempt,
                previous.attempt,
            )
            return
        own = self._context.own
        try:
            staged = offer_slot(
                self._context.staging,
                self.layout,
                transfer_id=command.transfer_id,
                prefill_tp_size=p_tp,
                writers=list(writers),
                blocks=command.block_ids,
                num_tokens=command.num_tokens,  # the tokens after the cached blocks, as prefill plans them
            )
            message = RegistrationMessage(
                transfer_id=command.transfer_id,
                attempt=command.attempt,
                decode_engine_id=self._engine_id,
                decode_host=self._host,
                decode_port=self._side_channel_port,
                decode_tp_rank=rank,
                decode_tp_size=d_tp,
                num_tokens=command.num_tokens,
                num_blocks=self.layout.num_blocks,
                block_ids=command.block_ids,
                agent_name=own.agent_name,
                agent_metadata=own.agent_metadata,
                region_base_addresses=own.region_base_addresses,
                layout_fingerprint=self._context.layout_fingerprint,
                cached_blocks=command.cached_blocks,
                device_id=self._context.device_id,
                placement=self.layout.placement.value,
                lifetime_ms=int((deadline - now + REGISTRATION_GRACE_S) * 1000),
                doorbell_port=own.doorbell_port,
                staging=tuple(share.offer for share in staged.values()),
            )
            frame = self._fit(message)
            self._tracker.expect(command.transfer_id, command.attempt, writers, deadline)
        except ProtocolError as error:
            self._fail_registration(command.transfer_id, FailureReason.INVALID_REGISTRATION, str(error))
            return
        except ValueError as error:
            self._fail_registration(command.transfer_id, FailureReason.CAPACITY, str(error))
            return
        timeline.mark(Milestone.ASKED, now)
        self._pushes[command.transfer_id] = PushWait(
            command.attempt, writers, command.prefill, timeline, staged=staged
        )
        for sent, agent in enumerate(writers.values()):
            if self._context.send_frame(agent, frame):
                self._context.count("registrations_sent")  # delivered ones only: a retry is not counted twice
                continue
            detail = f"could not send the registration to prefill agent {agent}"
            if sent == 0 and previous is None:
                self._unregister(command, handshake, detail, now)
            else:
                # Ranks that did get it may write: fence like any other failure.
                self._tracker.cancel(command.transfer_id, FailureReason.WRITE_FAILED, detail, now)
            return

    def _unregister(self, command: ExpectPush, handshake: Handshaking, detail: str, now: float) -> None:
        """The registration reached no writer, so nothing can land in its blocks: forget it without a fence,
        and look the engine up again (its agents may be a restarted engine's old ones)."""
        self._tracker.withdraw(command.transfer_id)
        self._pushes.pop(command.transfer_id, None)
        self._context.give_back_slot(command.transfer_id)
        self._look_up_again(handshake, FailureReason.UNREACHABLE, detail, now)

    def _handshake_failed(self, handshake: Handshaking, error: Exception, now: float) -> None:
        """The prefill's info could not be had or loaded. Not answering (refused, timed out, broken off: gone
        or frozen, or a restarted engine's old agents behind a cached answer) is no incompatibility; an answer
        that cannot be read or loaded is."""
        unreachable = isinstance(error, (ConnectionError, OSError, PeerUnreachable))
        reason = FailureReason.UNREACHABLE if unreachable else FailureReason.INCOMPATIBLE
        detail = f"handshake with {handshake.command.prefill.engine_id} failed: {error}"
        self._look_up_again(handshake, reason, detail, now)

    def _look_up_again(self, handshake: Handshaking, reason: FailureReason, detail: str, now: float) -> None:
        """A prefill engine restarted under the same coordinates answers under new agents, while decode may
        still hold the old ones: drop what decode knew of it and look it up afresh, once, before the transfer
        fails."""
        assert self._side_channel is not None
        command = handshake.command
        self._side_channel.invalidate(command.prefill)
        if handshake.looked_up_again or handshake.deadline <= now:
            self._fail(command.transfer_id, reason, detail)
            return
        log.info("transfer %s: %s; looking prefill %s up again", command.transfer_id, detail, command.prefill)
        self._context.count("prefills_looked_up_again")
        self._lookup(command, handshake.deadline, handshake.timeline, again=True)

    def _fail_registration(self, transfer_id: str, reason: FailureReason, detail: str) -> None:
        """A registration that was never sent: nobody can write into what it would have offered."""
        if transfer_id not in self._pushes:
            self._context.give_back_slot(transfer_id)
        self._fail(transfer_id, reason, detail)

    def _fit(self, message: RegistrationMessage) -> bytes:
        frame, trimmed = registration_frame(message, self._context.transport.notification_limit)
        if trimmed:
            self._context.count("registrations_without_metadata")
        return frame

    def _abort_writers(self, abort: AbortWriters) -> None:
        """Tell the writers decode gave up; each answers once quiet. Re-handshake next time: a silent or
        failing peer may have restarted under the same coordinates."""
        waiting = self._pushes.get(abort.transfer_id)
        if waiting is None:
            return
        # poll_probes asks the side channel, now and then, whether the writers' engine is still there.
        if self._side_channel is not None:
            self._side_channel.invalidate(waiting.prefill)
        detail = abort.detail[:MAX_DETAIL_CHARS]
        message = AbortMessage(
            transfer_id=abort.transfer_id,
            attempt=abort.attempt,
            decode_rank=self.layout.tp_rank,
            detail=detail,
        )
        for rank in abort.ranks:
            self._context.send(waiting.writers[rank], message)

    # --- pull: reads ----------------------------------------------------------------------------------------

    def _post_reads(
        self, command: ReadBlocks, deadline: float, engine: EngineInfo, timeline: Timeline, now: float
    ) -> None:
        rank, d_tp = self.layout.tp_rank, self.layout.tp_size
        timeline.mark(Milestone.ASKED, now)
        reading = Reading(command, deadline, {}, {}, timeline)
        self._reads[command.transfer_id] = reading
        sources = writers_for(rank, engine.tp_size, d_tp)
        # Every source rank holds the blocks for this READ: all of them are told if it fails, posted or not.
        reading.agents.update({p: engine.ranks[p].agent_name for p in sources})
        try:
            for p in sources:
                source = engine.rank_layout(self.layout.model, p)
                plan = plan_transfer(
                    source,
                    self.layout,
                    command.remote_block_ids,
                    command.block_ids,
                    num_tokens=command.num_tokens,
                )
                remote, local = plan.to_descriptors(
                    engine.ranks[p].region_base_addresses,
                    self._context.region_addrs,
                    src_device_id=engine.ranks[p].device_id,
                    dst_device_id=self._context.device_id,
                )
                done = ReadDoneMessage(
                    transfer_id=command.transfer_id,
                    attempt=0,
                    decode_rank=rank,
                    decode_tp_size=d_tp,
                    bytes_read=plan.nbytes,
                )
                reading.handles[p] = self._context.transport.read(
                    engine.ranks[p].agent_name, local, remote, encode(done)
                )
                self._context.count("reads_posted")
                reading.nbytes += plan.nbytes
        except (ValueError, TransportError) as error:
            self._end_read(command.transfer_id, FailureReason.WRITE_FAILED, f"cannot post READ: {error}", now)

    def _end_read(self, transfer_id: str, reason: FailureReason | None, detail: str, now: float) -> None:
        """Finish a pull on this rank. Success: report. Failure: cancel the READs still in flight; the ones
        the transport cannot stop keep the transfer (and both sides' blocks) until they end, then it
        closes."""
        reading = self._reads[transfer_id]
        if reason is None:
            del self._reads[transfer_id]
            stages = received_stages(reading, now)
            self._context.report(
                TransferResult(
                    transfer_id, ResultKind.FINISHED_RECVING, Outcome.RECEIVED, detail, reading.nbytes, stages
                )
            )
            return
        reading.ending = (reason, detail)
        self._failed_reads += 1
        for p, handle in list(reading.handles.items()):
            if self._context.state(handle).finished:
                self._context.release(handle)
                del reading.handles[p]
            elif self._context.cancel(handle):
                del reading.handles[p]
        if reading.handles:
            self._stuck[transfer_id] = now
            self._context.count("reads_stuck")
            log.error(
                "transfer %s: READs from prefill ranks %s cannot be cancelled; their blocks stay pinned",
                transfer_id,
                sorted(reading.handles),
            )
            return
        self._close_failed_read(transfer_id)

    def _close_failed_read(self, transfer_id: str) -> None:
        """No READ of a failed pull is in flight any more: tell every source rank to free, then report."""
        reading = self._reads.pop(transfer_id)
        assert reading.ending is not None and not reading.handles
        self._failed_reads -= 1
        self._stuck.pop(transfer_id, None)
        reason, detail = reading.ending
        if self._side_channel is not None:
            self._side_channel.invalidate(reading.command.prefill)
        abort = AbortMessage(
            transfer_id=transfer_id,
            attempt=0,
            decode_rank=self.layout.tp_rank,
            detail=detail[:MAX_DETAIL_CHARS],
        )
        for agent in reading.agents.values():
            self._context.send(agent, abort)
        self._fail(transfer_id, reason, detail)

    # --- results --------------------------------------------------------------------------------------------

    def _report_failure(self, failure: TransferFailure) -> None:
        self._context.report(
            TransferResult(
                failure.transfer_id, ResultKind.FAILED_RECVING, failure.reason, failure_detail(failure)
            )
        )

    def _fail(self, transfer_id: str, reason: FailureReason, detail: str) -> None:
        self._context.report(TransferResult(transfer_id, ResultKind.FAILED_RECVING, reason, detail))
