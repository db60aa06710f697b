"""The prefill side of a rank's transfer worker: finished blocks held for decode, WRITEs posted, blocks
released.

Push: the :class:`RendezvousTable` pairs finished prefills with decode registrations; its events
become transport calls here (post a WRITE per paired decode rank, release abandoned ones, tell
decode why a transfer failed) and its ``Closed`` events become ``finished_sending`` results.
Pull: :class:`PullHolds` keeps finished blocks until every decode rank reading them sent its
read-done notice, an abort arrives or the lease ends. Inputs come from the worker thread's loop
(commands, the notifications meant for prefill, polling, deadlines) with its clock ``now``; this
side shares nothing with the decode side but the :class:`WorkerContext` and the :class:`PeerRegistry`.
"""

from __future__ import annotations

import logging

import numpy as np

from pdconnector.layout import BlockPlacement, LayerKind, RankLayout, TransferPlan, plan_transfer
from pdconnector.layout.staging import TransferPath, choose_path, gather_copy
from pdconnector.protocol.messages import (
    AbortMessage,
    CompletionMessage,
    ReadDoneMessage,
    RegistrationMessage,
    StagingOffer,
    encode,
)
from pdconnector.protocol.pairing import PrefillBlocks
from pdconnector.protocol.pull import PullHolds, Released
from pdconnector.protocol.rendezvous import (
    AbandonWrite,
    Closed,
    Event,
    NotifyDecode,
    RendezvousLimits,
    RendezvousTable,
    StartWrite,
    WriteKey,
)
from pdconnector.transport.base import TransferHandle, TransferState, TransportError
from pdconnector.worker.commands import PrefillDone
from pdconnector.worker.context import ResultKind, TransferResult, WorkerContext
from pdconnector.worker.peers import PeerRegistry

log = logging.getLogger(__name__)


class PrefillSide:
    def __init__(
        self, context: WorkerContext, peers: PeerRegistry, *, limits: RendezvousLimits, pull_lease_s: float
    ) -> None:
        self.layout = layout = context.layout
        self._context = context
        self._peers = peers
        self._table = RendezvousTable(
            prefill_rank=layout.tp_rank,
            prefill_tp_size=layout.tp_size,
            block_size=layout.model.block_size,
            ssm_groups=frozenset(group.index for group in layout.groups if group.kind is LayerKind.SSM),
            limits=limits,
            layout_fingerprint=context.layout_fingerprint,
        )
        self._holds = PullHolds(
            prefill_rank=layout.tp_rank, prefill_tp_size=layout.tp_size, lease_s=pull_lease_s
        )
        self._writes: dict[WriteKey, TransferHandle] = {}
        self._stuck: dict[WriteKey, float] = {}  # past their deadline and not cancellable: since when

    def stuck_since(self) -> float | None:
        """When the oldest WRITE that could not be cancelled passed its deadline (None: there is none)."""
        return min(self._stuck.values(), default=None)

    @property
    def busy(self) -> bool:
        """Whether a transfer may be moving: a WRITE in flight ends only in the transport's state, and a
        decode READ from held blocks may need this agent to progress (UCX over TCP emulates RDMA with messages
        both sides handle). Blocks waiting for a registration are not: the registration rings."""
        return bool(self._writes or self._holds)

    def next_deadline(self) -> float | None:
        return min(
            (d for d in (self._table.next_deadline(), self._holds.next_deadline()) if d is not None),
            default=None,
        )

    def handles(self) -> list[TransferHandle]:
        """The WRITEs in flight (for shutdown)."""
        return list(self._writes.values())

    # --- inputs ---------------------------------------------------------------------------------------------

    def prefill_done(self, command: PrefillDone, now: float) -> None:
        self._context.count("prefills_finished")
        try:
            if command.pull:
                self._report_released(
                    self._holds.hold(
                        PrefillBlocks(command.transfer_id, command.block_ids, command.num_tokens), now
                    )
                )
            else:
                self._apply(
                    self._table.prefill_finished(
                        command.transfer_id, command.block_ids, command.num_tokens, now
                    ),
                    now,
                )
        except ValueError as error:
            log.error("transfer %s: %s", command.transfer_id, error)

    def cancel(self, transfer_id: str, detail: str, now: float) -> None:
        self._apply(self._table.cancel(transfer_id, detail, now), now)
        self._report_released(self._holds.cancel(transfer_id, detail, now))

    def on_message(
        self, message: RegistrationMessage | AbortMessage | ReadDoneMessage, now: float, *, sender: str
    ) -> None:
        """A notification meant for prefill (decode registering, giving up, or done reading) from agent
        ``sender``."""
        match message:
            case RegistrationMessage():
                self._context.count("registrations_received")
                if message.agent_metadata:
                    try:
                        self._peers.load(
                            message.agent_metadata,
                            engine_id=message.decode_engine_id,
                            tp_rank=message.decode_tp_rank,
                        )
                    except TransportError as error:
                        log.warning(
                            "registration of %s: cannot load decode agent %s: %s",
                            message.transfer_id,
                            message.agent_name,
                            error,
                        )
                if message.agent_name in self._peers:
                    self._context.set_doorbell(message.agent_name, message.decode_host, message.doorbell_port)
                self._apply(self._table.registration_received(message, now), now)
            case AbortMessage() if message.transfer_id in self._holds:
                self._report_released(self._holds.notice_received(message, now))
            case AbortMessage():
                # Unknown to both tables, it may be a pull abort overtaking its hold: the holds keep it for a
                # lease.
                self._apply(self._table.abort_received(message, now, sender=sender), now)
                self._holds.notice_received(message, now)
            case ReadDoneMessage():
                self._report_released(self._holds.notice_received(message, now))

    def poll(self, now: float) -> bool:
        """Collect the WRITEs that ended."""
        progressed = False
        for key, handle in list(self._writes.items()):
            status = self._context.state(handle)
            if not status.finished:
                continue
            del self._writes[key]
            self._stuck.pop(key, None)
            self._context.release(handle)
            self._context.give_back_slot(key)
            progressed = True
            if status.state is TransferState.DONE:
                self._context.ring(handle.peer)  # the WRITE's completion notification is on its way to decode
                self._apply(self._table.write_done(key, now), now)
            else:
                self._apply(self._table.write_failed(key, f"WRITE failed: {status.error}", now), now)
        return progressed

    def expire(self, now: float) -> bool:
        progressed = False
        deadline = self._table.next_deadline()
        if deadline is not None and deadline <= now:
            events = self._table.expire(now)
            self._apply(events, now)
            progressed |= bool(events)
        for released in self._holds.expire(now):
            self._report_released(released)
            progressed = True
        return progressed

    # --- rendezvous events -> transport ---------------------------------------------------------------------

    def _apply(self, events: list[Event], now: float) -> None:
        pending = list(events)
        while pending:
            event = pending.pop(0)
            match event:
                case StartWrite():
                    pending += self._start_write(event, now)
                case AbandonWrite(key=key):
                    pending += self._cancel_write(key, now)
                case NotifyDecode(agent=agent, message=message):
                    self._context.send(agent, message)
                case Closed(
                    transfer_id=transfer_id, outcome=outcome, detail=detail, blocks=blocks, stages=stages
                ):
                    if blocks is not None:
                        self._context.report(
                            TransferResult(
                                transfer_id, ResultKind.FINISHED_SENDING, outcome, detail, stages=stages
                            )
                        )

    def _cancel_write(self, key: WriteKey, now: float) -> list[Event]:
        """A WRITE past its deadline: gone once the transport confirms the cancel; otherwise it stays pinned
        and polled."""
        handle = self._writes.get(key)
        if handle is None:
            return self._table.write_failed(key, "WRITE cancelled after its deadline", now)
        if self._context.cancel(handle):
            del self._writes[key]
            self._context.give_back_slot(key)
            return self._table.write_failed(key, "WRITE cancelled after its deadline", now)
        self._stuck[key] = now
        self._context.count("writes_stuck")
        log.error(
            "transfer %s: WRITE to decode rank %d cannot be cancelled; its blocks stay pinned",
            key.transfer_id,
            key.decode_rank,
        )
        return []

    def _start_write(self, event: StartWrite, now: float) -> list[Event]:
        registration, key = event.registration, event.key
        try:
            # Loaded when the registration or the handshake arrived; gone if that decode rank restarted since
            # (never reloaded from an old registration: bytes meant for its previous life must not reach the
            # new one).
            if registration.agent_name not in self._peers:
                raise TransportError(
                    f"decode agent {registration.agent_name!r} is not loaded (restarted since it "
                    "registered, or never announced)"
                )
            destination = RankLayout(
                self.layout.model,
                registration.decode_tp_size,
                registration.decode_tp_rank,
                registration.num_blocks,
                BlockPlacement(registration.placement),
            )
            if len(registration.region_base_addresses) != len(destination.regions):
                count = len(registration.region_base_addresses)
                raise ValueError(
                    f"registration has {count} region addresses, the layout has {len(destination.regions)}"
                )
            plan = plan_transfer(
                self.layout,
                destination,
                event.prefill.block_ids,
                registration.block_ids,
                num_tokens=event.prefill.num_tokens,
            )
            offer = self._staging_offer(plan, registration, key)
            if offer is None:
                local, remote = plan.to_descriptors(
                    self._context.region_addrs,
                    registration.region_base_addresses,
                    src_device_id=self._context.device_id,
                    dst_device_id=registration.device_id,
                )
            else:
                local, remote = self._gathered(plan, offer, registration.device_id, key)
            notification = encode(
                CompletionMessage(
                    transfer_id=key.transfer_id,
                    attempt=key.attempt,
                    prefill_rank=self.layout.tp_rank,
                    prefill_tp_size=self.layout.tp_size,
                    bytes_written=plan.nbytes,
                    staged=offer is not None,
                )
            )
            self._writes[key] = self._context.transport.write(
                registration.agent_name, local, remote, notification
            )
            self._context.count("writes_posted")
        except (ValueError, RuntimeError, TransportError) as error:
            self._context.give_back_slot(key)
            return self._table.write_failed(key, f"cannot post WRITE: {error}", now)
        return []

    def _staging_offer(
        self, plan: TransferPlan, registration: RegistrationMessage, key: WriteKey
    ) -> StagingOffer | None:
        """Decode's offer for this rank when the request goes staged (a slot of this rank's buffer then held
        by ``key``), None when it goes direct: no buffer or no offer, too large for either slot, the cost
        model or the configured path says direct, or every slot is busy."""
        staging, rank = self._context.staging, self.layout.tp_rank
        offer = next((o for o in registration.staging if o.prefill_rank == rank), None)
        if staging is None or offer is None or not len(plan) or staging.config.path is TransferPath.DIRECT:
            return None
        room = min(staging.slot_bytes, offer.nbytes)
        if plan.nbytes > room:
            self._context.count("staging_too_large")
            return None
        if staging.config.path is None:
            choice = choose_path(len(plan), plan.nbytes, room, staging.config.costs)
            if choice.path is TransferPath.DIRECT:
                return None
        if staging.take(key) is None:
            self._context.count("staging_slots_busy")
            return None
        return offer

    def _gathered(
        self, plan: TransferPlan, offer: StagingOffer, device_id: int, key: WriteKey
    ) -> tuple[np.ndarray, np.ndarray]:
        """Gather the plan's runs into ``key``'s slot; returns the descriptor pair that moves it into the
        offer."""
        staging = self._context.staging
        slot = staging.held(key) if staging is not None else None
        if staging is None or slot is None:
            raise RuntimeError(f"transfer {key.transfer_id}: no staging slot held")
        staging.gather(gather_copy(plan), slot.addr)
        self._context.count("writes_staged")
        local = np.array([[slot.addr, plan.nbytes, self._context.device_id]], dtype=np.int64)
        remote = np.array([[offer.address, plan.nbytes, device_id]], dtype=np.int64)
        return local, remote

    def _report_released(self, released: Released | None) -> None:
        if released is not None:
            outcome, detail = released.outcome, released.detail
            self._context.report(
                TransferResult(
                    released.transfer_id, ResultKind.FINISHED_SENDING, outcome, detail, stages=released.stages
                )
            )
