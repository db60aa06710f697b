"""The scheduler side of the connector: which requests move KV, which blocks, and when their blocks may be
freed.

It sees vLLM requests only through the handful of attributes it reads (``request_id``,
``kv_transfer_params``, ``num_prompt_tokens``, ``num_computed_tokens``, ``status``, the prompt
token lists for the hybrid trim), so its state machine runs in unit tests with plain objects.

Decode: a request with ``do_remote_prefill`` claims the prompt tokens it lacks as external and
asynchronous (vLLM parks it in WAITING_FOR_REMOTE_KVS); the allocation step stages its
registration (push) or READ (pull) with the blocks it does not hold already (prefix-cache
aware) and the next ``build_meta`` ships it, in the same engine step. Its result comes back
through the workers' ``finished_recving`` / ``failed_recving``. An abort while the transfer
is in flight cancels it and keeps the blocks until the workers confirm nothing writes into
them any more.

Prefill: a finished request with ``do_remote_decode`` keeps its blocks (``delay_free``) until
every worker reports the transfer id ended (written, read, expired or cancelled); the
returned ``kv_transfer_params`` are what a pull-mode decode needs.

Models with SSM layers: prefill stops one prompt token short and decode recomputes that
token, so decode derives the last state itself (vLLM's own contract for Mamba P/D).

The KV tier (``tier_slots`` > 0, dense models): a decode request's blocks after vLLM's prefix-cache hits are
split between the tier (the leading run it holds, :func:`pdconnector.tier.split.split_prefix`) and prefill
(the rest: the registration's ``cached_blocks`` grows by the run, a READ covers only the rest); a request that
received its KV and finished normally has its computed full blocks saved (the prompt and what it generated,
the next turn's history), its blocks freed once every rank copied them. On prefill, the tier's run after the
prefix-cache hits is loaded before the step computes the rest (:meth:`TierPlan.prefill_load`), and a prompt
whose KV left for decode is saved after its transfer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdconnector.protocol.params import (
    ERROR_KEY,
    RECEIVED_KEY,
    REMOTE_HOLD_KEY,
    REMOTE_INCARNATION_KEY,
    TRANSFER_ID_KEY,
    TRANSFER_MODE_KEY,
    EngineRole,
    TransferMode,
    TransferParamsError,
    TransferRequest,
    mint_incarnation,
    parse_transfer_params,
)
from pdconnector.protocol.timeline import Stage
from pdconnector.vllm.config import ConnectorConfig
from pdconnector.vllm.decode_plan import Block, decode_command, local_blocks, waited_s
from pdconnector.vllm.metadata import (
    Command,
    FailRequest,
    LoadFromTier,
    PDConnectorMetadata,
    ReleaseBlocks,
    TierFailures,
)
from pdconnector.vllm.prompt_tokens import PromptTokens
from pdconnector.vllm.stats import PDTransferStats, TokenSource
from pdconnector.vllm.tier_plan import TierPlan
from pdconnector.worker.commands import (
    AbandonTransfer,
    BlockIds,
    CancelTransfer,
    ExpectPush,
    PrefillDone,
    ReadBlocks,
)

log = logging.getLogger(__name__)

_TRIMMED_KEY = "_pd_prompt_trimmed"
_STAGED_KEY = "_pd_staged"


@dataclass(frozen=True)
class EngineCoordinates:
    """This engine as peers reach it (what pull-mode prefill returns to the router)."""

    engine_id: str
    host: str
    side_channel_port: int
    tp_size: int
    incarnation: str = field(default_factory=mint_incarnation)  # this start of the engine


@dataclass
class _Incoming:
    transfer_id: str
    mode: TransferMode
    blocks: int  # from prefill
    tier_blocks: int = 0  # from the KV tier
    failed: bool = False


class SchedulerSide:
    """Args:
    ssm_groups: indices of vLLM's KV cache groups holding SSM state (one state block moves per request).
    block_size: tokens per block of the attention groups (prefix hits are whole blocks).
    finished_statuses: the request statuses that mean "completed normally" (vLLM's ``FINISHED_STOPPED`` /
    ``FINISHED_LENGTH_CAPPED``); anything else is an abort or an error.
    hash_block_size: tokens per hash of vLLM's ``request.block_hashes`` (a divisor of ``block_size``).
    tier_slots: blocks the KV tier holds per rank (0: no tier).
    """

    def __init__(
        self,
        config: ConnectorConfig,
        engine: EngineCoordinates,
        *,
        num_groups: int,
        ssm_groups: frozenset[int],
        block_size: int,
        finished_statuses: frozenset[Any],
        hash_block_size: int | None = None,
        tier_slots: int = 0,
    ) -> None:
        self.config = config
        self.engine = engine
        self.num_groups = num_groups
        self.ssm_groups = ssm_groups
        self.block_size = block_size
        self.finished_statuses = finished_statuses
        self.backoff_tokens = 1 if ssm_groups else 0
        self.tier = (
            TierPlan(tier_slots, block_size=block_size, hash_block_size=hash_block_size or block_size)
            if tier_slots
            else None
        )
        self._lock = threading.Lock()  # peers arrive from the side-channel thread
        self._commands: list[Command] = []
        self._engine_info: bytes | None = None
        self._engine_info_shipped = False
        self._peers: list[bytes] = []
        self._incoming: dict[str, _Incoming] = {}  # decode requests whose transfer has not ended
        self._received: dict[str, _Incoming] = {}  # decode requests that received, until they finish
        self._holding: dict[str, str] = {}  # prefill request id -> transfer id, blocks kept for decode
        self._resuming: dict[str, float] = {}  # decode requests whose KV arrived, until scheduled: since when
        # prefill requests looked up in the tier -> their prefix-cache hits (blocks), until vLLM allocates
        self._prefill_gpu_hits: dict[str, int] = {}
        self._prompt_tokens = PromptTokens()
        # the stages vLLM's scheduler adds around a transfer (admission, resume)
        self._stats = PDTransferStats()

    # --- handshake plumbing ---------------------------------------------------------------------------------

    def set_engine_info(self, encoded: bytes) -> None:
        with self._lock:
            self._engine_info = encoded
            self._engine_info_shipped = False

    def peer_announced(self, encoded: bytes) -> None:
        with self._lock:
            self._peers.append(encoded)

    # --- both roles -----------------------------------------------------------------------------------------

    def _params(self, request: Any) -> dict[str, Any] | None:
        params = request.kv_transfer_params
        return params if isinstance(params, dict) else None

    def _parse(self, params: Mapping[str, Any]) -> TransferRequest:
        return parse_transfer_params({TRANSFER_MODE_KEY: self.config.mode.value, **params})

    def on_new_request(self, request: Any) -> None:
        """Prefill of a model with SSM layers: compute all but the last prompt token (decode recomputes
        it)."""
        params = self._params(request)
        if (
            not self.backoff_tokens
            or params is None
            or params.get("do_remote_decode") is not True
            or params.get(_TRIMMED_KEY)
        ):
            return
        if request.num_prompt_tokens <= self.backoff_tokens or request.prompt_token_ids is None:
            return
        del request.prompt_token_ids[-self.backoff_tokens :]
        del request._all_token_ids[-self.backoff_tokens :]
        request.num_prompt_tokens -= self.backoff_tokens
        request.max_tokens = 1
        params[_TRIMMED_KEY] = True

    def remote_token_count(self, num_prompt_tokens: int) -> int:
        """Prompt tokens decode takes from prefill (all but the backoff tokens it recomputes)."""
        return (
            num_prompt_tokens - self.backoff_tokens
            if num_prompt_tokens > self.backoff_tokens
            else num_prompt_tokens
        )

    # --- external tokens: decode's from prefill, prefill's from its KV tier ---------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = self._params(request)
        if params is None or params.get(_STAGED_KEY):
            return 0, False
        if params.get("do_remote_decode") is True and self.tier is not None:
            # vLLM may ask again before it allocates (no room this step): the latest answer is the one staged.
            self._prefill_gpu_hits[request.request_id] = num_computed_tokens // self.block_size
            return self.tier.prefill_hit(request, num_computed_tokens), False
        if params.get("do_remote_prefill") is not True:
            return 0, False
        available = self.remote_token_count(request.num_prompt_tokens)
        remote_tokens = params.get("remote_num_tokens")
        if isinstance(remote_tokens, int) and not isinstance(remote_tokens, bool) and remote_tokens > 0:
            available = min(available, remote_tokens)
        count = available - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Any, block_groups: Sequence[Sequence[Block]], num_external_tokens: int
    ) -> None:
        params = self._params(request)
        gpu_hits = self._prefill_gpu_hits.pop(request.request_id, None)
        if gpu_hits is not None and self.tier is not None:
            blocks = [block.block_id for block in block_groups[0]]
            load, tokens = self.tier.prefill_load(request, blocks, gpu_hits, num_external_tokens)
            self._prompt_tokens.plan(request.request_id, tokens)
            if load is not None:
                self._stage(load)
            return
        if params is None or params.get("do_remote_prefill") is not True or params.get(_STAGED_KEY):
            return
        params[_STAGED_KEY] = True
        if num_external_tokens <= 0:
            # Decode holds every token already: nothing to receive, and prefill may free its copy now.
            self._abandon(
                request.request_id,
                params,
                f"decode request {request.request_id} holds every prompt token already",
            )
            return
        request_id = request.request_id
        try:
            transfer = self._parse(params)
            if transfer.role is not EngineRole.DECODE or transfer.remote is None:
                raise TransferParamsError(
                    "do_remote_prefill", "a decode leg needs the prefill engine's coordinates"
                )
            owner = self._decode_owner(transfer.transfer_id)
            if owner is not None:
                # The workers know a transfer by its id alone: a second request under it would take over the
                # first's results (which then never ends) and could be written with bytes meant for the other.
                raise TransferParamsError(
                    TRANSFER_ID_KEY,
                    f"{transfer.transfer_id} is already in use by request {owner} on this engine",
                )
            local, cached = local_blocks(block_groups, num_groups=self.num_groups, ssm_groups=self.ssm_groups)
            waited = waited_s(request)
            command = self._decode_command(
                request_id, transfer, local, cached, num_external_tokens, waited=waited
            )
            command, tokens = self._with_tier(request, transfer, command, cached=cached, waited=waited)
            self._prompt_tokens.plan(request_id, tokens)
            self._stats.record_stages({Stage.ADMISSION.value: waited})
        except (TransferParamsError, ValueError) as error:
            self._stage(FailRequest(request_id, f"request {request_id}: {error}"))
            self._incoming[request_id] = _Incoming(
                str(params.get(TRANSFER_ID_KEY, "")), self.config.mode, 0, failed=True
            )
            return
        from_tier = len(command.block_ids) if isinstance(command, LoadFromTier) else 0
        self._incoming[request_id] = _Incoming(
            transfer.transfer_id, transfer.mode, sum(len(g) for g in local) - from_tier, from_tier
        )
        self._stage(command)

    def _decode_command(
        self,
        request_id: str,
        transfer: TransferRequest,
        local: BlockIds,
        cached: int,
        num_tokens: int,
        *,
        waited: float,
    ) -> ExpectPush | ReadBlocks:
        return decode_command(
            request_id,
            transfer,
            local,
            cached,
            num_tokens,
            ssm_groups=self.ssm_groups,
            lease_s=self.config.lease_s,
            waited_s=waited,
        )

    def _with_tier(
        self,
        request: Any,
        transfer: TransferRequest,
        full: ExpectPush | ReadBlocks,
        *,
        cached: int,
        waited: float,
    ) -> tuple[Command, dict[TokenSource, int]]:
        """The decode command for a request, and its prompt tokens by source: ``full`` (every block from
        prefill), or, where the tier holds the leading run of the blocks to fill, a load of that run followed
        by the transfer of the rest."""
        num_tokens = full.num_tokens
        tokens = {TokenSource.GPU: cached * self.block_size, TokenSource.REMOTE: num_tokens}
        split = self.tier.split(request, full.block_ids[0], cached) if self.tier is not None else None
        if split is None or not split.tier_blocks:
            return full, tokens
        from_tier = min(num_tokens, len(split.tier_blocks) * self.block_size)
        rest: ExpectPush | ReadBlocks | AbandonTransfer
        if split.remote_blocks:
            rest = self._decode_command(
                request.request_id,
                transfer,
                (split.remote_blocks,),
                split.cached_blocks,
                num_tokens - from_tier,
                waited=waited,
            )
        else:
            assert transfer.remote is not None
            detail = f"decode request {request.request_id} took every prompt token it lacked from its KV tier"
            rest = AbandonTransfer(request.request_id, transfer.transfer_id, transfer.remote, detail)
        tokens |= {TokenSource.TIER: from_tier, TokenSource.REMOTE: num_tokens - from_tier}
        load = LoadFromTier(
            request.request_id, split.tier_slots, split.tier_blocks, then=rest, otherwise=full
        )
        return load, tokens

    def external_tokens(self, request_id: str) -> dict[TokenSource, int]:
        """The external tokens vLLM was told of for this request, by planned source (empty: none planned)."""
        return self._prompt_tokens.external(request_id)

    def _decode_owner(self, transfer_id: str) -> str | None:
        """The live decode request (receiving, or received and still running) that uses ``transfer_id``, if
        any."""
        live = [*((r, i) for r, i in self._incoming.items() if not i.failed), *self._received.items()]
        return next(
            (request_id for request_id, incoming in live if incoming.transfer_id == transfer_id), None
        )

    def _stage(self, command: Command) -> None:
        with self._lock:
            self._commands.append(command)

    # --- per step -------------------------------------------------------------------------------------------

    def build_meta(self, scheduled: Iterable[str] = ()) -> PDConnectorMetadata:
        """This step's commands for the workers; ``scheduled``: the requests this step runs (a received one
        resumes). A step that runs none lets the workers wait for a transfer to end: vLLM keeps stepping an
        engine whose requests wait for KV (or hold blocks for a send), and each empty step returned at once
        would cost the CPU a core's worth of scheduling for nothing."""
        scheduled = list(scheduled)
        if self._resuming:
            now = time.monotonic()
            for request_id in scheduled:
                since = self._resuming.pop(request_id, None)
                if since is not None:
                    self._stats.record_stages({Stage.RESUME.value: now - since})
        with self._lock:
            meta = PDConnectorMetadata(
                commands=self._commands,
                peers=self._peers,
                idle_wait_s=0.0 if scheduled else self.config.idle_step_wait_s,
            )
            if self._engine_info is not None and not self._engine_info_shipped:
                meta.engine = self._engine_info
                self._engine_info_shipped = True
            self._commands, self._peers = [], []
        return meta

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._commands or self._peers)

    def update_connector_output(self, finished_recving: set[str], failed_recving: set[str]) -> set[str]:
        """The receives that ended this step. Returns the failed ones whose blocks must stay allocated (the
        ``fail`` policy: vLLM ends the request now, while a prefill may still write into its blocks); each
        rank gives them back through ``finished_sending`` once its fence ended (:class:`ReleaseBlocks`)."""
        now = time.monotonic()
        held = set()
        for request_id in finished_recving:
            incoming = self._incoming.pop(request_id, None)
            if incoming is None or incoming.failed:  # refused before any transfer: nothing can be written
                continue
            if request_id not in failed_recving:
                self._received[request_id] = incoming
                self._resuming[request_id] = now
                continue
            if self.config.recompute_on_failure:  # else vLLM ends the request unserved: it counts nothing
                fell_back = (TokenSource.TIER, TokenSource.REMOTE)
                self._prompt_tokens.moved(request_id, fell_back, TokenSource.COMPUTED)
            else:
                held.add(request_id)
                self._stage(ReleaseBlocks(request_id))
        return held

    def take_stats(self) -> PDTransferStats | None:
        """The scheduler's stages and finished requests' prompt tokens since the last call (merged by vLLM
        with the workers' stats), or None. vLLM asks after the step's worker reports: their corrections
        count."""
        for request_id, tokens in self._prompt_tokens.take().items():
            self._stats.record_tokens(tokens)
            if self.config.log_timeline:
                counts = " ".join(f"{s.value}={tokens[s]}" for s in TokenSource if tokens.get(s))
                log.info("request %s prompt tokens: %s", request_id, counts)
        return self._stats.take()

    def take_events(self) -> list[Any]:
        """The KV tier's cache events since the last step (vLLM publishes them with its own)."""
        return self.tier.take_events() if self.tier is not None else []

    def tier_failed(self, failures: TierFailures) -> None:
        """Some rank could not copy these requests' blocks into its tier (reported before their
        ``finished_sending``) or out of it (the blocks came from prefill, or prefill computed them)."""
        if self.tier is not None:
            for request_id in failures.saves:
                self.tier.save_failed(request_id)
        for request_id in failures.loads:
            instead = TokenSource.REMOTE if request_id in self._incoming else TokenSource.COMPUTED
            self._prompt_tokens.moved(request_id, (TokenSource.TIER,), instead)
            if (incoming := self._incoming.get(request_id)) is not None:
                incoming.blocks += incoming.tier_blocks
                incoming.tier_blocks = 0

    def finished_sending(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            self._holding.pop(request_id, None)
            if self.tier is not None:
                self.tier.saved(request_id)

    # --- end of a request -----------------------------------------------------------------------------------

    def request_finished(
        self, request: Any, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        self._resuming.pop(request_id, None)
        self._prefill_gpu_hits.pop(request_id, None)
        self._prompt_tokens.finished(request_id, served=request.status in self.finished_statuses)
        params = self._params(request)
        incoming = self._incoming.get(request_id)
        if incoming is not None and incoming.failed:
            # Refused before any transfer began (its id may be another request's): nothing to cancel, nothing
            # written.
            del self._incoming[request_id]
            return False, None
        if incoming is not None:
            # Aborted while receiving: keep the blocks until the workers confirm no write lands in them any
            # more.
            self._stage(
                CancelTransfer(
                    request_id,
                    incoming.transfer_id,
                    f"decode request {request_id} ended before its KV arrived",
                )
            )
            return True, None
        received = self._received.pop(request_id, None)
        if received is not None:
            return self._save_to_tier(request, block_ids), {
                TRANSFER_ID_KEY: received.transfer_id,
                RECEIVED_KEY: {
                    "transfer_id": received.transfer_id,
                    "mode": received.mode.value,
                    "blocks": received.blocks,
                    "tier_blocks": received.tier_blocks,
                },
            }
        if params is not None and params.get("do_remote_prefill") is True and not params.get(_STAGED_KEY):
            # Ended (aborted) before it had blocks: prefill would hold its copy until its lease.
            self._abandon(request_id, params, f"decode request {request_id} ended before it allocated blocks")
            return False, None
        if params is None or params.get("do_remote_decode") is not True:
            return False, None  # a local request: the tier keeps what decode received (and computed after)
        return self._prefill_finished(request, params, block_ids)

    def _save_to_tier(self, request: Any, block_ids: Sequence[Sequence[int]]) -> bool:
        """Stage the save of a finished request's blocks the tier lacks; True: its blocks stay allocated until
        every rank copied them (``finished_sending``)."""
        if self.tier is None or request.status not in self.finished_statuses or not block_ids:
            return False
        save = self.tier.save(request, block_ids[0])
        if save is not None:
            self._stage(save)
        return save is not None

    def _abandon(self, request_id: str, params: Mapping[str, Any], detail: str) -> None:
        """Tell the prefill engine a decode leg will never take its KV (unusable parameters: nobody to
        tell)."""
        try:
            transfer = self._parse(params)
        except TransferParamsError:
            return
        if transfer.remote is not None and self._decode_owner(transfer.transfer_id) is None:
            self._stage(AbandonTransfer(request_id, transfer.transfer_id, transfer.remote, detail))

    def _prefill_finished(
        self, request: Any, params: dict[str, Any], block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        try:
            transfer = self._parse(params)
        except TransferParamsError as error:
            log.error("prefill request %s keeps no KV for decode: %s", request_id, error)
            return False, {ERROR_KEY: str(error)}
        owner = next(
            (
                other
                for other, held in self._holding.items()
                if held == transfer.transfer_id and other != request_id
            ),
            None,
        )
        if owner is not None:
            # Neither held nor cancelled: the transfer under this id is the other request's.
            detail = str(
                TransferParamsError(
                    TRANSFER_ID_KEY,
                    f"{transfer.transfer_id} is already held for request {owner} on this engine",
                )
            )
            log.error("prefill request %s keeps no KV for decode: %s", request_id, detail)
            return False, {ERROR_KEY: detail}
        if request.status not in self.finished_statuses:
            self._stage(
                CancelTransfer(
                    request_id,
                    transfer.transfer_id,
                    f"prefill request {request_id} ended with {request.status}",
                )
            )
            return False, None
        blocks = self._prefill_blocks(block_ids)
        if not any(blocks):
            return False, None
        num_tokens = int(request.num_computed_tokens)
        self._holding[request_id] = transfer.transfer_id
        save = self.tier.save(request, blocks[0], after_send=True) if self.tier is not None else None
        if save is not None:
            self._stage(save)  # copied once the KV left: freed with the transfer's finished_sending
        self._stage(
            PrefillDone(
                request_id, transfer.transfer_id, blocks, num_tokens, transfer.mode is TransferMode.PULL
            )
        )
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            TRANSFER_ID_KEY: transfer.transfer_id,
            TRANSFER_MODE_KEY: transfer.mode.value,
            "remote_block_ids": [list(group) for group in blocks],
            "remote_engine_id": self.engine.engine_id,
            "remote_host": self.engine.host,
            "remote_port": self.engine.side_channel_port,
            "tp_size": self.engine.tp_size,
            REMOTE_INCARNATION_KEY: self.engine.incarnation,
            "remote_num_tokens": num_tokens,
            REMOTE_HOLD_KEY: int(self.config.lease_s * 1000),
        }

    def _prefill_blocks(self, block_ids: Sequence[Sequence[int]]) -> BlockIds:
        if len(block_ids) != self.num_groups:
            raise ValueError(f"expected blocks for {self.num_groups} KV cache groups, got {len(block_ids)}")
        return tuple(
            (tuple(group[-1:]) if g in self.ssm_groups else tuple(group)) for g, group in enumerate(block_ids)
        )

    def holds(self, request_id: str) -> bool:
        return request_id in self._holding
