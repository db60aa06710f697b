"""``PDConnector``: the class vLLM loads (``kv_connector_module_path: pdconnector.vllm.connector``).

It only routes vLLM's calls: scheduler-role instances to :class:`SchedulerSide` (plus the
engine's side-channel server, started once every rank's agent is known), worker-role
instances to :class:`WorkerSide`. See :mod:`pdconnector.vllm.config` for the configuration.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from pdconnector.layout import BlockPlacement, ConvLayout
from pdconnector.layout.staging import staging_cost_blocks
from pdconnector.vllm.config import ConnectorConfig, parse_connector_config, requested_kv_cache_layout
from pdconnector.vllm.kv_layout import (
    LayoutMismatch,
    cache_groups,
    kv_buffer_device,
    memory_regions,
    rank_layout,
)
from pdconnector.vllm.metadata import PDConnectorMetadata, RankHandshake, TierFailures
from pdconnector.vllm.scheduler import EngineCoordinates, SchedulerSide
from pdconnector.vllm.stats import PDPromMetrics, PDTransferStats, TokenSource
from pdconnector.vllm.tier_memory import rank_tier, tier_slots
from pdconnector.vllm.worker import WorkerSide
from pdconnector.worker.identity import EngineInfo, RankInfo, layout_summary
from pdconnector.worker.side_channel import SideChannelServer

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# vLLM's names for where our external tokens came from (``vllm:prompt_tokens_cached_by_source``)
_HIT_SOURCES = {TokenSource.TIER: CacheHitSource.HOST, TokenSource.REMOTE: CacheHitSource.P2P}


def _route_logs_to_vllm() -> None:
    """Our packages log under ``pdconnector``; vLLM configures only its own logger, so print ours its way."""
    ours, theirs = logging.getLogger("pdconnector"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(theirs.handlers[0].formatter)
    ours.addHandler(handler)
    ours.setLevel(os.environ.get("PDCONNECTOR_LOG_LEVEL", "INFO"))
    ours.propagate = False


_route_logs_to_vllm()

_FINISHED_NORMALLY = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED})
_encoder = msgspec.msgpack.Encoder()
_rank_decoder = msgspec.msgpack.Decoder(RankInfo)


def _connector_config(vllm_config: VllmConfig) -> ConnectorConfig:
    kv = vllm_config.kv_transfer_config
    assert kv is not None
    return parse_connector_config(
        engine_id=kv.engine_id,
        extra=kv.kv_connector_extra_config,
        buffer_device=kv.kv_buffer_device,
        failure_policy=kv.kv_load_failure_policy,
        env=os.environ,
    )


_NEMOTRON_H_LAYER_CODES = {
    "mamba": "M",
    "linear_attention": "M",
    "attention": "*",
    "full_attention": "*",
    "mlp": "-",
    "moe": "E",
}


def _hf_config(vllm_config: VllmConfig) -> dict[str, Any]:
    """The model's HF config as the layout model reads it; NemotronH's layer pattern under either of its
    spellings."""
    hf_config = vllm_config.model_config.hf_config
    config = hf_config.to_dict()
    pattern = getattr(hf_config, "hybrid_override_pattern", None) or config.get("hybrid_override_pattern")
    if pattern is None and config.get("model_type") == "nemotron_h" and config.get("layers_block_type"):
        pattern = "".join(_NEMOTRON_H_LAYER_CODES[kind] for kind in config["layers_block_type"])
    if pattern is not None:
        config["hybrid_override_pattern"] = pattern
    return config


def _conv_layout(kv_cache_config: KVCacheConfig) -> ConvLayout:
    layout = ConvLayout(get_conv_state_layout())
    if cache_groups(kv_cache_config).ssm_groups and layout is not ConvLayout.DS:
        raise LayoutMismatch(
            "hybrid models need the DS conv state layout: set VLLM_SSM_CONV_STATE_LAYOUT=DS on every "
            "prefill and decode engine"
        )
    return layout


# What a request's descriptors number under each placement (scattered blocks), for the log line when vLLM
# overrides ours.
_DESCRIPTOR_COST = {
    BlockPlacement.LAYER_OUTER: "one descriptor per layer per block",
    BlockPlacement.BLOCK_OUTER: "one descriptor per block (per layer per block between engines of different "
    "TP)",
    BlockPlacement.HEAD_OUTER: "one descriptor per block",
}


class PDConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = _connector_config(vllm_config)
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._scheduler: SchedulerSide | None = None
        self._server: SideChannelServer | None = None
        self._worker: WorkerSide | None = None
        if role is KVConnectorRole.SCHEDULER:
            groups = cache_groups(kv_cache_config)
            engine = EngineCoordinates(
                self.config.engine_id,
                self.config.side_channel_host,
                self.config.side_channel_port,
                self._tp_size,
            )
            self._scheduler = SchedulerSide(
                self.config,
                engine,
                num_groups=groups.num_groups,
                ssm_groups=groups.ssm_groups,
                block_size=groups.block_size,
                finished_statuses=_FINISHED_NORMALLY,
                hash_block_size=kv_cache_config.hash_block_size,
                tier_slots=tier_slots(self.config.tier_bytes, kv_cache_config),
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Block-outermost by default (few descriptors per request); vLLM drops it, with a warning, for a
        backend that refuses it, and :meth:`register_kv_caches` says what that costs."""
        transfer = vllm_config.kv_transfer_config
        return requested_kv_cache_layout(transfer.kv_connector_extra_config if transfer is not None else None)

    # --- worker side ----------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        device = kv_buffer_device(self.config.buffer_device, kv_caches)
        resolved = self._vllm_config.cache_config.get_resolved_kv_cache_layout().name
        layout = rank_layout(
            _hf_config(self._vllm_config),
            self._kv_cache_config,
            kv_caches,
            tp_size=self._tp_size,
            tp_rank=get_tensor_model_parallel_rank(),
            conv_layout=_conv_layout(self._kv_cache_config),
            resolved_layout=resolved,
            speculative=self._vllm_config.speculative_config is not None,
        )
        if resolved != self.config.kv_cache_layout and layout.tp_rank == 0:
            log.warning(
                "PDConnector asked vLLM for a %s KV cache; the attention backend or VLLM_KV_CACHE_LAYOUT "
                "chose %s, so a transfer costs %s",
                self.config.kv_cache_layout,
                resolved,
                _DESCRIPTOR_COST[layout.placement],
            )
        regions = memory_regions(layout, self._kv_cache_config, kv_caches, device)
        tier = (
            rank_tier(layout, self._kv_cache_config, kv_caches, regions, self.config.tier_bytes)
            if self.config.tier_bytes
            else None
        )
        self._worker = WorkerSide(self.config, layout, regions, tier)
        self._rank_info = self._worker.start()
        self._layout_summary = layout_summary(layout.model)
        log.info(
            "PDConnector rank %d: %d regions of %d B registered on %s:%d (%s, kernel block %d of %d tokens, "
            "%s, %s)",
            layout.tp_rank,
            len(regions),
            layout.regions[0].nbytes,
            device.value,
            regions[0].device_id,
            self._rank_info.agent_name,
            layout.model.kernel_block_size,
            layout.model.block_size,
            layout.model.attention.layout if layout.model.attention else "no attention",
            layout.placement,
        )
        if self.config.staging_mib:
            staging_bytes = self.config.staging_mib * 2**20
            log.info(
                "PDConnector rank %d: staging buffer of %d MiB in %d slots on %s:%d, from the memory vLLM "
                "leaves beside the KV cache; as KV cache it would hold %d blocks",
                layout.tp_rank,
                self.config.staging_mib,
                self.config.staging_slots,
                device.value,
                regions[0].device_id,
                staging_cost_blocks(staging_bytes, layout),
            )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None:
            return None
        return RankHandshake(_encoder.encode(self._rank_info), self._layout_summary)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PDConnectorMetadata) and self._worker is not None
        self._worker.apply(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        results = self._worker.results()
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_tier_failures() if self._worker is not None else None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            return self._worker.take_stats()
        return self._scheduler.take_stats() if self._scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PDTransferStats(data) if data is not None else PDTransferStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PDPromMetrics:
        return PDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._server is not None:
            self._server.close()
            self._server = None

    # --- scheduler side -------------------------------------------------------------------------------------

    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "scheduler-side call on a worker-side connector"
        return self._scheduler

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Every rank's agent is known: build this engine's description and serve it on the side channel."""
        handshakes = [m for _, m in sorted(metadata.items()) if isinstance(m, RankHandshake)]
        ranks = tuple(_rank_decoder.decode(m.rank_info) for m in handshakes)
        # The workers saw the tensors (kernel block, layout); the scheduler side only serves what they found.
        summaries = {json.dumps(m.layout, sort_keys=True) for m in handshakes}
        if len(summaries) != 1:
            raise LayoutMismatch(
                f"engine {self.config.engine_id}: TP ranks report different KV layouts: {sorted(summaries)}"
            )
        scheduler = self._sched()
        info = EngineInfo(
            self.config.engine_id,
            self._tp_size,
            handshakes[0].layout,
            ranks,
            incarnation=scheduler.engine.incarnation,
        )
        scheduler.set_engine_info(_encoder.encode(info))
        self._server = SideChannelServer(
            self.config.side_channel_host,
            self.config.side_channel_port,
            engine_info=lambda: info,
            on_announce=lambda peer: scheduler.peer_announced(_encoder.encode(peer)),
        )
        log.info(
            "PDConnector %s: side channel on %s:%d (%s, TP %d)",
            info.engine_id,
            self.config.side_channel_host,
            self._server.port,
            self.config.mode,
            self._tp_size,
        )

    def on_new_request(self, request: Request) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # The transfer fills every group (SSM state included), so vLLM must not zero those blocks.
        return self._kv_cache_config.transfer_group_ids

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks.blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        tokens = self._sched().external_tokens(request.request_id)
        if not tokens:  # refused before a transfer was planned: vLLM's own label
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return {_HIT_SOURCES[source]: count for source, count in tokens.items()}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduled = [r.req_id for r in scheduler_output.scheduled_new_reqs] + list(
            scheduler_output.scheduled_cached_reqs.req_ids
        )
        return self._sched().build_meta(scheduled)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        scheduler = self._sched()
        if isinstance(failures := connector_output.kv_connector_worker_meta, TierFailures):
            scheduler.tier_failed(failures)  # before the finished_sending / finished_recving they precede
        held = scheduler.update_connector_output(
            set(connector_output.finished_recving or ()), set(connector_output.failed_recving or ())
        )
        if held:
            # vLLM has ended these requests (their receive failed) and frees the blocks of a finished request
            # on its finished_recving, right after this call: keep them out of it until every rank's fence
            # ended and reported them in finished_sending.
            connector_output.finished_recving.difference_update(held)
        scheduler.finished_sending(set(connector_output.finished_sending or ()))

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)
