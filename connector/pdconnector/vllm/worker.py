"""The worker side of the connector, one per TP rank: owns the rank's :class:`TransferWorker` and reports its
results.

Per step it hands the scheduler's commands to the transfer worker (non-blocking queue puts)
and drains the worker's results; every network operation runs on the transfer worker's
thread, so an engine step never waits for a peer. Results are reported by vLLM request id;
a failed receive is reported in ``failed_recving`` and ``finished_recving`` both, as vLLM
expects, so the request leaves WAITING_FOR_REMOTE_KVS. Under the ``fail`` policy that happens as soon as the
transfer fails, also while a prefill may still write into its blocks (the fence): vLLM answers the client
then, the scheduler side keeps the blocks and sends :class:`ReleaseBlocks`, and this rank answers it in
``finished_sending`` once its fence ended. Under ``recompute`` the request would reuse its blocks at once, so
its failure waits for the fence.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from pdconnector.layout import RankLayout
from pdconnector.protocol.rendezvous import Outcome, RendezvousLimits
from pdconnector.tier.store import RankTier
from pdconnector.transport.base import MemoryRegion, Transport
from pdconnector.transport.factory import create_transport
from pdconnector.transport.mock_faults import MockFaults
from pdconnector.vllm.config import ConnectorConfig
from pdconnector.vllm.metadata import (
    Command,
    FailRequest,
    LoadFromTier,
    PDConnectorMetadata,
    ReleaseBlocks,
    SaveToTier,
    TierFailures,
)
from pdconnector.vllm.stats import COUNTED_EVENTS, Direction, PDTransferStats
from pdconnector.worker.commands import AbandonTransfer, CancelTransfer, ExpectPush, PrefillDone, ReadBlocks
from pdconnector.worker.context import ResultKind
from pdconnector.worker.identity import EngineInfo, RankInfo, agent_name
from pdconnector.worker.side_channel import SideChannelClient
from pdconnector.worker.staging import StagingConfig
from pdconnector.worker.transfer_worker import TransferWorker, WorkerConfig

log = logging.getLogger(__name__)

_engine_decoder = msgspec.msgpack.Decoder(EngineInfo)


@dataclass
class TransferResults:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)

    def any(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.failed_recving)


@dataclass(frozen=True)
class _Live:
    """A transfer this rank was told about: whose it is and when, for the wait it adds to the request."""

    request_id: str
    since: float


class WorkerSide:
    """Args:
    regions: this rank's memory regions in ``layout.regions`` order (see
    :func:`pdconnector.vllm.kv_layout.memory_regions`).
    tier: this rank's KV tier, if the engine has one.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        layout: RankLayout,
        regions: list[MemoryRegion],
        tier: RankTier | None = None,
    ) -> None:
        self.config = config
        self.layout = layout
        self._tier = tier
        self._engine: EngineInfo | None = None
        self._client = SideChannelClient(
            announce=self._own_engine, timeout_s=min(10.0, config.transfer_timeout_s)
        )
        limits = RendezvousLimits(
            registration_lease_s=config.lease_s,
            prefill_lease_s=max(300.0, config.transfer_timeout_s),
            write_timeout_s=config.transfer_timeout_s,
        )
        worker_config = WorkerConfig(
            engine_id=config.engine_id,
            host=config.side_channel_host,
            side_channel_port=config.side_channel_port,
            limits=limits,
            pull_lease_s=config.lease_s,
            fence_s=config.fence_s,
            heartbeat_dir=config.heartbeat_dir,
            staging=StagingConfig(config.staging_mib * 2**20, config.staging_slots, config.transfer_path),
        )
        self._live: dict[str, _Live] = {}  # by transfer id, while the transfer is live
        self._stats = PDTransferStats()
        self._events_seen: dict[str, int] = {}
        # Set by the transfer thread after each result it reports; an idle step waits on it.
        self._result_ready = threading.Event()
        self._idle_wait_s = 0.0
        self._worker = TransferWorker(
            layout,
            regions,
            self._transport_factory(),
            config=worker_config,
            side_channel=self._client,
            on_result=self._result_ready.set,
        )
        self._immediate = TransferResults()
        # requests failed early whose fence still runs -> whether the scheduler asked for the blocks back
        self._held: dict[str, bool] = {}
        self._saves_after_send: dict[str, SaveToTier] = {}  # prefill: by request id, until its transfer ends
        self._tier_failures = TierFailures()
        self._load_errors: set[int] = set()

    def _transport_factory(self) -> Callable[[], Transport]:
        name = agent_name(self.config.engine_id, self.layout.tp_rank)
        if self.config.uses_mock_transport:
            faults = MockFaults.from_env(os.environ)
            return lambda: create_transport("mock", name, host=self.config.side_channel_host, faults=faults)
        return lambda: create_transport("nixl", name, backends=list(self.config.backends))

    def start(self) -> RankInfo:
        return self._worker.start()

    def _own_engine(self) -> EngineInfo:
        if self._engine is None:
            raise RuntimeError(
                f"engine {self.config.engine_id}: handshake metadata not received from the scheduler yet"
            )
        return self._engine

    def apply(self, meta: PDConnectorMetadata) -> None:
        """Hand one step's commands to the transfer worker (never blocks)."""
        self._idle_wait_s = meta.idle_wait_s
        if meta.engine is not None:
            self._engine = _engine_decoder.decode(meta.engine)
        for peer in meta.peers:
            self._worker.add_peers(_engine_decoder.decode(peer))
        now = time.monotonic()
        for command in meta.commands:
            log.debug("rank %d: %s", self.layout.tp_rank, command)
            self._run(command, now)

    def _run(self, command: Command, now: float) -> None:
        timeout = self.config.transfer_timeout_s
        match command:
            case PrefillDone():
                self._live[command.transfer_id] = _Live(command.request_id, now)
                self._worker.prefill_finished(
                    command.transfer_id, command.block_ids, command.num_tokens, pull=command.pull
                )
            case ExpectPush():
                self._live[command.transfer_id] = _Live(command.request_id, now)
                self._worker.expect_push(
                    command.transfer_id,
                    command.prefill,
                    command.block_ids,
                    command.num_tokens,
                    timeout_s=timeout,
                    attempt=command.attempt,
                    cached_blocks=command.cached_blocks,
                )
            case ReadBlocks():
                self._live[command.transfer_id] = _Live(command.request_id, now)
                self._worker.read(
                    command.transfer_id,
                    command.prefill,
                    command.remote_block_ids,
                    command.block_ids,
                    command.num_tokens,
                    timeout_s=min(timeout, command.valid_for_s),
                )
            case CancelTransfer():
                self._worker.cancel(command.transfer_id, command.detail)
            case AbandonTransfer():
                self._worker.abandon(
                    command.transfer_id, command.prefill, command.detail, timeout_s=min(10.0, timeout)
                )
            case FailRequest():
                log.error("%s", command.detail)
                self._stats.record(Direction.RECV, Outcome.REFUSED, wait_s=self._counted(0.0))
                self._immediate.finished_recving.add(command.request_id)
                self._immediate.failed_recving.add(command.request_id)
            case ReleaseBlocks():
                if command.request_id in self._held:  # fenced here still: answered when it ends
                    self._held[command.request_id] = True
                else:
                    self._immediate.finished_sending.add(command.request_id)
            case LoadFromTier():
                self._load_from_tier(command, now)
            case SaveToTier():
                self._save_to_tier(command)

    def _load_from_tier(self, command: LoadFromTier, now: float) -> None:
        """Decode: the tier's run first, then the rest's transfer; if this rank cannot load it, every block's.
        Prefill: the run before this step's forward; if this rank cannot load it, vLLM hears of its blocks."""
        assert self._tier is not None, "a tier command reached an engine without a tier"
        try:
            self._tier.load(command.slots, command.block_ids)
        except Exception as error:  # any failure here has the same remedy: the blocks come from elsewhere
            remedy = "recomputing them" if command.otherwise is None else "taking them from prefill"
            log.error(
                "request %s: loading %d blocks from the KV tier failed (%s); %s",
                command.request_id,
                len(command.slots),
                error,
                remedy,
            )
            self._stats.count_events({"tier_loads_failed": 1})
            self._tier_failures.loads.add(command.request_id)
            if command.otherwise is None:
                self._load_errors.update(command.block_ids)
            else:
                self._run(command.otherwise, now)
            return
        if command.then is None:
            return
        self._run(command.then, now)
        if isinstance(command.then, AbandonTransfer):  # the tier held every block the request lacked
            self._immediate.finished_recving.add(command.request_id)

    def _save_to_tier(self, command: SaveToTier) -> None:
        """Copy the blocks, then let vLLM free them; a prefill's copy waits for the end of its transfer."""
        if command.after_send:
            self._saves_after_send[command.request_id] = command
            return
        self._copy_to_tier(command)
        self._immediate.finished_sending.add(command.request_id)

    def _copy_to_tier(self, command: SaveToTier) -> None:
        """The blocks are freed after a failure too: the scheduler side hears of it and drops the slots."""
        assert self._tier is not None, "a tier command reached an engine without a tier"
        try:
            self._tier.save(command.block_ids, command.slots)
        except Exception as error:
            log.error(
                "request %s: saving %d blocks to the KV tier failed: %s",
                command.request_id,
                len(command.slots),
                error,
            )
            self._stats.count_events({"tier_saves_failed": 1})
            self._tier_failures.saves.add(command.request_id)

    def take_load_errors(self) -> set[int]:
        """Blocks of this step's synchronous loads (prefill's tier) that did not load (vLLM's
        ``get_block_ids_with_load_errors``)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_tier_failures(self) -> TierFailures | None:
        """Requests whose tier save or load failed on this rank since the last call, if any."""
        failures, self._tier_failures = self._tier_failures, TierFailures()
        return failures or None

    def results(self) -> TransferResults:
        """The transfers that ended since the last call; in a step that runs no request, first wait up to the
        step's ``idle_wait_s`` for one to end (a result wakes the wait at once)."""
        if self._idle_wait_s > 0 and not self._immediate.any() and self._live:
            self._result_ready.wait(self._idle_wait_s)
        self._idle_wait_s = 0.0
        self._result_ready.clear()  # before taking them: a result reported from here on sets it again
        out, self._immediate = self._immediate, TransferResults()
        now = time.monotonic()
        if not self.config.recompute_on_failure:
            self._fail_early(out, now)
        for result in self._worker.results():
            log.debug("rank %d: %s", self.layout.tp_rank, result)
            live = self._live.pop(result.transfer_id, None)
            if live is None:
                log.warning(
                    "transfer %s ended (%s: %s) but no request of this engine owns it",
                    result.transfer_id,
                    result.outcome,
                    result.detail,
                )
                continue
            if result.kind is ResultKind.FAILED_RECVING and live.request_id in self._held:
                if self._held.pop(live.request_id):  # failed early, and its fence ended now
                    out.finished_sending.add(live.request_id)
                continue
            direction = Direction.SEND if result.kind is ResultKind.FINISHED_SENDING else Direction.RECV
            self._stats.record(
                direction, result.outcome, wait_s=self._counted(now - live.since), nbytes=result.nbytes
            )
            request_id = live.request_id
            if self.layout.tp_rank == 0:
                self._stats.record_stages(result.stages)
                if self.config.log_timeline:
                    stages = " ".join(
                        f"{name}={seconds * 1e3:.3f}ms" for name, seconds in result.stages.items()
                    )
                    log.info(
                        "request %s transfer %s %s %s: %s",
                        request_id,
                        result.transfer_id,
                        direction.value,
                        result.outcome,
                        stages,
                    )
            match result.kind:
                case ResultKind.FINISHED_SENDING:
                    if (save := self._saves_after_send.pop(request_id, None)) is not None:
                        self._copy_to_tier(save)  # the KV left (or was given up on): the blocks are intact
                    out.finished_sending.add(request_id)
                case ResultKind.FINISHED_RECVING:
                    out.finished_recving.add(request_id)
                case ResultKind.FAILED_RECVING:
                    log.error(
                        "request %s: KV transfer %s failed (%s): %s [worker %s]",
                        request_id,
                        result.transfer_id,
                        result.outcome,
                        result.detail,
                        self._worker.stats(),
                    )
                    out.finished_recving.add(request_id)
                    out.failed_recving.add(request_id)
        return out

    def _fail_early(self, out: TransferResults, now: float) -> None:
        """Fail the requests whose receive failed while a peer may still write into their blocks."""
        for failing in self._worker.failing():
            live = self._live.get(failing.transfer_id)
            if live is None:
                continue
            self._held[live.request_id] = False
            self._stats.record(Direction.RECV, failing.outcome, wait_s=self._counted(now - live.since))
            log.error(
                "request %s: KV transfer %s failed (%s): %s; its blocks are kept until no peer can write "
                "into them [worker %s]",
                live.request_id,
                failing.transfer_id,
                failing.outcome,
                failing.detail,
                self._worker.stats(),
            )
            out.finished_recving.add(live.request_id)
            out.failed_recving.add(live.request_id)

    def take_stats(self) -> PDTransferStats | None:
        """The transfers that ended and the fence events since the last call (vLLM's per-step stats), or
        None."""
        counters = self._worker.stats()
        self._stats.count_events(
            {name: counters.get(name, 0) - self._events_seen.get(name, 0) for name in COUNTED_EVENTS}
        )
        self._events_seen = {name: counters.get(name, 0) for name in COUNTED_EVENTS}
        return self._stats.take()

    def _counted(self, wait_s: float) -> float | None:
        return wait_s if self.layout.tp_rank == 0 else None

    def close(self) -> None:
        self._worker.close()
        self._client.close()
