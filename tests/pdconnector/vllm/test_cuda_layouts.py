"""The connector's layout handling against KV caches exactly as vLLM 0.32's GPU model runner builds them (on
the CPU).

Every transfer case plants tagged K/V and Mamba state through the views vLLM's kernels read, on the prefill
ranks that write into one decode rank; plans with our planner; copies descriptor by descriptor, by address,
between the raw buffers vLLM allocated; and reads back through the decode rank's kernel views: every token of
the request at every layer and head holds what prefill planted for that global head and position, and no byte
outside the request's blocks (the HMA padding of its Mamba pages included) changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch
from pdconnector.layout import BlockPlacement, ConvLayout, RankLayout, plan_transfer, writers_for
from pdconnector.transport.base import Device, TransportError
from pdconnector.transport.descriptors import RegionTable
from pdconnector.vllm.config import DEFAULT_KV_CACHE_LAYOUT
from pdconnector.vllm.kv_layout import (
    LayoutMismatch,
    kv_buffer_device,
    memory_regions,
    model_spec,
    rank_layout,
)
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

from tests.pdconnector.vllm.cuda_caches import (
    BACKENDS,
    NEMOTRON_H,
    NEMOTRON_H_TWO_KV_HEADS,
    PREFILL_FILL,
    QWEN3_32B,
    SENTINEL,
    RankCache,
    Request,
    arrived,
    build_rank_cache,
    clear_request,
    copy_descriptors,
    plant,
    scattered_request,
)

NUM_BLOCKS = 8  # per rank: room for a request's scattered blocks in every KV cache group
DENSE_TOKENS = 37  # three 16-token blocks, the last one partly filled
HYBRID_TOKENS = 1500  # two 1040-token blocks (FlashInfer: 94 of their 130 kernel blocks hold tokens)


@dataclasses.dataclass(frozen=True)
class Pair:
    """A prefill TP size writing into one rank of a decode TP size."""

    prefill_tp: int
    decode_tp: int
    decode_rank: int

    def __str__(self) -> str:
        return f"P-TP{self.prefill_tp}-to-D-TP{self.decode_tp}-rank{self.decode_rank}"


SAME_TP_ONE_HEAD, SAME_TP_FOUR_HEADS = Pair(8, 8, 5), Pair(2, 2, 1)
TP2_TO_TP8, TP8_TO_TP2 = Pair(2, 8, 5), Pair(8, 2, 1)
# Above the model's 8 KV heads ranks replicate them: decode rank 5 of TP 16 holds head 2, as rank 4 does.
SAME_TP_REPLICATED, TP16_TO_TP4, TP4_TO_TP16 = Pair(16, 16, 5), Pair(16, 4, 1), Pair(4, 16, 5)
REPLICATED_PAIRS = [SAME_TP_REPLICATED, TP16_TO_TP4, TP4_TO_TP16]

SelectLayout = Callable[[str], None]


@pytest.fixture(autouse=True, scope="module")
def _engine_env() -> Iterator[None]:
    """What an engine serving a hybrid model through the connector sets (the DS conv state layout), and one
    torch thread: these tests make many small tensor ops, which a thread pool only slows down on a busy CI
    machine."""
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
        mp.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
        get_conv_state_layout.cache_clear()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            get_conv_state_layout.cache_clear()


@pytest.fixture
def kv_cache_layout(monkeypatch: pytest.MonkeyPatch) -> SelectLayout:
    """Select the layout vLLM resolves: BLHNC is what our connector asks for (no override), others come from
    ``VLLM_KV_CACHE_LAYOUT`` as a user would set it."""

    def select(name: str) -> None:
        if name == DEFAULT_KV_CACHE_LAYOUT:
            monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
        else:
            monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", name)

    return select


def transfer(
    hf_config: Mapping[str, Any], backend: str, pair: Pair, *, num_blocks: int, num_tokens: int
) -> tuple[RankCache, Request]:
    """One request from every prefill rank that writes into the decode rank, as the connector would move it.

    Prefill ranks share the scheduler's block ids; the decode engine has other ids for the same request."""
    decode = build_rank_cache(
        hf_config, BACKENDS[backend], tp_size=pair.decode_tp, tp_rank=pair.decode_rank, num_blocks=num_blocks
    )
    decode.raw.fill_(SENTINEL)
    decode_request = scattered_request(decode, num_tokens, seed=2)
    decode_layout = decode.rank_layout()
    decode_regions = decode.memory_regions(decode_layout)
    for rank in writers_for(pair.decode_rank, pair.prefill_tp, pair.decode_tp):
        prefill = build_rank_cache(
            hf_config, BACKENDS[backend], tp_size=pair.prefill_tp, tp_rank=rank, num_blocks=num_blocks
        )
        prefill.raw.fill_(PREFILL_FILL)
        request = scattered_request(prefill, num_tokens, seed=1)
        assert request.blocks != decode_request.blocks
        plant(prefill, request)
        layout = prefill.rank_layout()
        regions = prefill.memory_regions(layout)
        plan = plan_transfer(
            layout, decode_layout, request.blocks, decode_request.blocks, num_tokens=num_tokens
        )
        src, dst = plan.to_descriptors(
            [r.addr for r in regions],
            [r.addr for r in decode_regions],
            src_device_id=regions[0].device_id,
            dst_device_id=decode_regions[0].device_id,
        )
        # What the transport checks before posting: every descriptor inside a region its side registered.
        RegionTable(regions).check(src, "local", f"prefill rank {rank}")
        RegionTable(decode_regions).check(dst, "remote", f"decode rank {pair.decode_rank}")
        copy_descriptors(prefill, decode, src, dst)
    return decode, decode_request


def written_outside(decode: RankCache, request: Request) -> int:
    """Bytes of the decode buffer that changed outside what vLLM's views give the request."""
    clear_request(decode, request)
    return int((decode.raw != SENTINEL).sum())


@pytest.mark.parametrize(
    "pair", [SAME_TP_ONE_HEAD, SAME_TP_FOUR_HEADS, TP2_TO_TP8, TP8_TO_TP2, *REPLICATED_PAIRS], ids=str
)
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC", "BHLNC"])
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"])
def test_dense_request_lands_on_every_layer_head_and_token_and_nowhere_else(
    kv_cache_layout: SelectLayout, backend: str, layout: str, pair: Pair
) -> None:
    kv_cache_layout(layout)
    decode, request = transfer(QWEN3_32B, backend, pair, num_blocks=NUM_BLOCKS, num_tokens=DENSE_TOKENS)
    assert decode.layout.name == layout
    assert arrived(decode, request) == []
    assert written_outside(decode, request) == 0


@pytest.mark.parametrize("pair", [SAME_TP_FOUR_HEADS, TP2_TO_TP8, TP8_TO_TP2], ids=str)
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER"])
def test_hybrid_request_lands_with_its_conv_and_temporal_state_and_no_padding_is_sent(
    kv_cache_layout: SelectLayout, backend: str, layout: str, pair: Pair
) -> None:
    kv_cache_layout(layout)
    decode, request = transfer(NEMOTRON_H, backend, pair, num_blocks=NUM_BLOCKS, num_tokens=HYBRID_TOKENS)
    assert decode.layout.name == layout
    assert decode.rank_layout().ssm_padding_bytes > 0  # the padding the check below covers exists
    assert arrived(decode, request) == []
    assert written_outside(decode, request) == 0


@pytest.mark.parametrize("pair", [Pair(4, 4, 1), Pair(8, 8, 5)], ids=str)
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER"])
def test_a_hybrid_with_fewer_kv_heads_than_ranks_moves_the_replicated_head_with_the_ssm_shard(
    kv_cache_layout: SelectLayout, backend: str, layout: str, pair: Pair
) -> None:
    kv_cache_layout(layout)
    decode, request = transfer(
        NEMOTRON_H_TWO_KV_HEADS, backend, pair, num_blocks=NUM_BLOCKS, num_tokens=HYBRID_TOKENS
    )
    assert decode.rank_layout().kv_heads_per_rank == 1
    assert arrived(decode, request) == []
    assert written_outside(decode, request) == 0


def test_hybrid_engines_whose_tp_changes_the_block_size_are_refused_by_name() -> None:
    """With replicated KV heads the attention page stops shrinking with TP while the SSM state still does, so
    vLLM picks a different block size per TP; such engines cannot pair."""
    with pytest.raises(ValueError, match="prefill and decode models differ in block_size"):
        transfer(
            NEMOTRON_H_TWO_KV_HEADS,
            "FLASH_ATTN",
            Pair(8, 2, 1),
            num_blocks=NUM_BLOCKS,
            num_tokens=HYBRID_TOKENS,
        )


def test_flashinfer_splits_the_large_hybrid_block_into_kernel_blocks_and_rank_layout_reads_them_off_the_views(
    kv_cache_layout: SelectLayout,
) -> None:
    """vLLM raises the hybrid block to 1040 tokens so an attention page holds the Mamba state; in a
    layer-outer cache FlashInfer (16/32/64 before SM100) then runs 16-token kernel blocks and the connector
    receives [num_blocks
    * 65, H, 16, C] views.
    FlashAttention's kernel block is any multiple of 16, so vLLM runs it on the 1040-token block unsplit."""
    kv_cache_layout("LBHNC")  # layer-outer: block-outermost caches are never split into kernel blocks
    flashinfer = build_rank_cache(
        NEMOTRON_H, BACKENDS["FLASHINFER"], tp_size=2, tp_rank=1, num_blocks=NUM_BLOCKS
    )
    flash_attn = build_rank_cache(
        NEMOTRON_H, BACKENDS["FLASH_ATTN"], tp_size=2, tp_rank=1, num_blocks=NUM_BLOCKS
    )
    attention = "model.layers.5.mixer.attn"
    assert flashinfer.kv_caches[attention].shape == (NUM_BLOCKS * 65, 4, 16, 256)
    model = flashinfer.rank_layout().model
    assert (model.block_size, model.kernel_block_size, model.physical_blocks_per_logical) == (1040, 16, 65)
    assert flash_attn.kv_caches[attention].shape == (NUM_BLOCKS, 4, 1040, 256)
    assert flash_attn.rank_layout().model.kernel_block_size == 1040


def test_prefill_and_decode_with_different_kernel_blocks_are_refused_by_the_planner(
    kv_cache_layout: SelectLayout,
) -> None:
    """FlashInfer's 16-token kernel blocks and FlashAttention's 1040-token block order the same tokens
    differently."""
    kv_cache_layout("LBHNC")  # layer-outer: block-outermost caches are never split into kernel blocks
    flashinfer = build_rank_cache(
        NEMOTRON_H, BACKENDS["FLASHINFER"], tp_size=2, tp_rank=1, num_blocks=NUM_BLOCKS
    )
    flash_attn = build_rank_cache(
        NEMOTRON_H, BACKENDS["FLASH_ATTN"], tp_size=2, tp_rank=1, num_blocks=NUM_BLOCKS
    )
    request = scattered_request(flashinfer, HYBRID_TOKENS, seed=1)
    with pytest.raises(ValueError, match="kernel_block_size"):
        plan_transfer(
            flashinfer.rank_layout(),
            flash_attn.rank_layout(),
            request.blocks,
            request.blocks,
            num_tokens=HYBRID_TOKENS,
        )


def test_regions_are_refused_for_a_layout_that_ignores_the_kernel_block(
    kv_cache_layout: SelectLayout,
) -> None:
    """Pages of a whole 1040-token block do not fit views of 16-token kernel blocks: registering them would be
    wrong."""
    kv_cache_layout("LBHNC")  # layer-outer: block-outermost caches are never split into kernel blocks
    cache = build_rank_cache(NEMOTRON_H, BACKENDS["FLASHINFER"], tp_size=2, tp_rank=1, num_blocks=NUM_BLOCKS)
    unsplit = model_spec(NEMOTRON_H, cache.kv_cache_config, conv_layout=ConvLayout.DS)
    with pytest.raises(LayoutMismatch, match="block stride"):
        memory_regions(
            RankLayout(unsplit, 2, 1, NUM_BLOCKS), cache.kv_cache_config, cache.kv_caches, Device.DRAM
        )


def test_a_head_outermost_layer_order_is_refused_by_name(kv_cache_layout: SelectLayout) -> None:
    """vLLM builds LHBNC (a layer's heads outside its blocks); the connector does not model it."""
    kv_cache_layout("LHBNC")
    cache = build_rank_cache(QWEN3_32B, BACKENDS["FLASH_ATTN"], tp_size=2, tp_rank=1, num_blocks=NUM_BLOCKS)
    assert cache.layout.name == "LHBNC"
    with pytest.raises(LayoutMismatch, match="KV cache layout LHBNC is not supported"):
        cache.rank_layout()


@pytest.mark.parametrize(
    ("hf_config", "backend"),
    [
        (QWEN3_32B, "FLASH_ATTN"),
        (QWEN3_32B, "TRITON_ATTN"),
        (QWEN3_32B, "FLASHINFER"),
        (NEMOTRON_H, "FLASHINFER"),
    ],
)
def test_vllm_gives_the_connector_the_block_outermost_cache_it_asks_for(
    hf_config: Mapping[str, Any], backend: str
) -> None:
    cache = build_rank_cache(hf_config, BACKENDS[backend], tp_size=2, tp_rank=1, num_blocks=NUM_BLOCKS)
    layout = cache.rank_layout()
    assert cache.layout.name == DEFAULT_KV_CACHE_LAYOUT
    assert (layout.placement, len(layout.regions)) == (BlockPlacement.BLOCK_OUTER, 1)
    # vLLM does not split a block other layers' pages sit in
    assert layout.model.physical_blocks_per_logical == 1


QWEN3_LAYERS = 64


@pytest.mark.parametrize(
    ("layout", "pair", "per_block"),
    [
        ("LBHNC", SAME_TP_FOUR_HEADS, QWEN3_LAYERS),
        ("BLHNC", SAME_TP_FOUR_HEADS, 1),
        ("BHLNC", SAME_TP_FOUR_HEADS, 1),
        ("LBHNC", TP2_TO_TP8, QWEN3_LAYERS),
        ("BLHNC", TP2_TO_TP8, QWEN3_LAYERS),
        ("BHLNC", TP2_TO_TP8, 1),
    ],
    ids=str,
)
def test_block_outermost_caches_move_a_scattered_request_in_one_descriptor_per_block(
    kv_cache_layout: SelectLayout, layout: str, pair: Pair, per_block: int
) -> None:
    """Qwen3-32B's 64 layers: layer-outer caches cost a descriptor per layer per block; BLHNC one per block
    between equal TP; BHLNC keeps a heterogeneous-TP head slice of every layer in one run as well."""
    kv_cache_layout(layout)
    prefill = build_rank_cache(
        QWEN3_32B, BACKENDS["FLASH_ATTN"], tp_size=pair.prefill_tp, tp_rank=0, num_blocks=NUM_BLOCKS
    )
    decode = build_rank_cache(
        QWEN3_32B, BACKENDS["FLASH_ATTN"], tp_size=pair.decode_tp, tp_rank=0, num_blocks=NUM_BLOCKS
    )
    # three full 16-token blocks, no two of them adjacent on either side
    plan = plan_transfer(
        prefill.rank_layout(), decode.rank_layout(), [[5, 1, 3]], [[2, 6, 0]], num_tokens=3 * 16
    )
    assert len(plan) == 3 * per_block


@pytest.mark.parametrize(
    ("hf_config", "backend", "built", "named"),
    [
        (QWEN3_32B, "FLASH_ATTN", "LBNHC", "LBHNC"),
        (QWEN3_32B, "FLASH_ATTN", "LBHNC", "LBNHC"),
        (NEMOTRON_H, "FLASHINFER", "LBNHC", "LBHNC"),
    ],
    ids=["dense-NHD-named-HND", "dense-HND-named-NHD", "hybrid-kernel-blocks-NHD-named-HND"],
)
def test_a_layout_name_the_view_strides_contradict_is_refused(
    kv_cache_layout: SelectLayout, hf_config: Mapping[str, Any], backend: str, built: str, named: str
) -> None:
    """The layout trust bug: with 4 heads a rank, the two orders have equal sizes but place head slices
    differently."""
    kv_cache_layout(built)
    cache = build_rank_cache(hf_config, BACKENDS[backend], tp_size=2, tp_rank=1, num_blocks=NUM_BLOCKS)
    with pytest.raises(
        LayoutMismatch, match=f"resolved the KV cache layout to {named}, but its view .* has strides"
    ):
        cache.rank_layout(resolved_layout=named)


def test_a_block_outermost_cache_named_lbhnc_is_refused_before_any_region_is_registered(
    kv_cache_layout: SelectLayout,
) -> None:
    """Its blocks have the in-block order LBHNC names, but other layers' pages sit between them."""
    kv_cache_layout("BLHNC")
    cache = build_rank_cache(QWEN3_32B, BACKENDS["FLASH_ATTN"], tp_size=2, tp_rank=1, num_blocks=NUM_BLOCKS)
    with pytest.raises(LayoutMismatch, match="block stride"):
        cache.memory_regions(cache.rank_layout(resolved_layout="LBHNC"))


def _on_cuda(cache: RankCache, index: int) -> RankCache:
    """The same cache, its views reporting ``cuda:index``: what the connector reads of a GPU rank's cache."""

    class OnCuda(torch.Tensor):
        @property
        def device(self) -> torch.device:  # type: ignore[override]
            return torch.device("cuda", index)

    return dataclasses.replace(
        cache, kv_caches={name: view.as_subclass(OnCuda) for name, view in cache.kv_caches.items()}
    )


def test_regions_and_descriptors_name_the_device_the_cache_is_on() -> None:
    """Prefill TP 8 rank 5 on cuda:5 writes into decode TP 2 rank 1 on cuda:1."""
    prefill = _on_cuda(
        build_rank_cache(QWEN3_32B, BACKENDS["FLASH_ATTN"], tp_size=8, tp_rank=5, num_blocks=NUM_BLOCKS), 5
    )
    decode = _on_cuda(
        build_rank_cache(QWEN3_32B, BACKENDS["FLASH_ATTN"], tp_size=2, tp_rank=1, num_blocks=NUM_BLOCKS), 1
    )
    src_layout, dst_layout = prefill.rank_layout(), decode.rank_layout()
    src_regions, dst_regions = (
        prefill.memory_regions(src_layout, "cuda"),
        decode.memory_regions(dst_layout, "cuda"),
    )
    assert {(r.device, r.device_id) for r in src_regions} == {(Device.VRAM, 5)}
    assert {(r.device, r.device_id) for r in dst_regions} == {(Device.VRAM, 1)}
    request = scattered_request(prefill, DENSE_TOKENS, seed=1)
    plan = plan_transfer(src_layout, dst_layout, request.blocks, request.blocks, num_tokens=DENSE_TOKENS)
    assert len(plan) > 0
    src_addrs, dst_addrs = [r.addr for r in src_regions], [r.addr for r in dst_regions]
    src, dst = plan.to_descriptors(
        src_addrs, dst_addrs, src_device_id=src_regions[0].device_id, dst_device_id=dst_regions[0].device_id
    )
    RegionTable(src_regions).check(src, "local", "prefill rank 5")
    RegionTable(dst_regions).check(dst, "remote", "decode rank 1")
    # Descriptors naming device 0 (what the planner used to emit) lie outside every region registered for that
    # device.
    src0, dst0 = plan.to_descriptors(src_addrs, dst_addrs)
    with pytest.raises(TransportError, match="dev 0"):
        RegionTable(src_regions).check(src0, "local", "prefill rank 5")
    with pytest.raises(TransportError, match="dev 0"):
        RegionTable(dst_regions).check(dst0, "remote", "decode rank 1")


def test_kv_buffer_device_must_name_the_memory_the_cache_is_in() -> None:
    cache = build_rank_cache(QWEN3_32B, BACKENDS["FLASH_ATTN"], tp_size=8, tp_rank=5, num_blocks=NUM_BLOCKS)
    gpu = _on_cuda(cache, 5)
    assert kv_buffer_device("cuda", gpu.kv_caches) is Device.VRAM
    assert kv_buffer_device("cpu", cache.kv_caches) is Device.DRAM
    with pytest.raises(LayoutMismatch, match="kv_buffer_device 'cpu' but the KV cache is in GPU memory"):
        kv_buffer_device("cpu", gpu.kv_caches)
    with pytest.raises(LayoutMismatch, match="kv_buffer_device 'cuda' but the KV cache is in host memory"):
        kv_buffer_device("cuda", cache.kv_caches)


def _with_mamba_spec(config: KVCacheConfig, **changes: Any) -> KVCacheConfig:
    groups = [
        KVCacheGroupSpec(g.layer_names, dataclasses.replace(g.kv_cache_spec, **changes))
        if isinstance(g.kv_cache_spec, MambaSpec)
        else g
        for g in config.kv_cache_groups
    ]
    return dataclasses.replace(config, kv_cache_groups=groups)


@pytest.mark.parametrize(
    ("changes", "speculative", "message"),
    [
        ({"mamba_cache_mode": "align"}, False, "mamba_cache_mode 'align'"),
        ({"num_speculative_blocks": 2}, False, r"speculative decoding \(--speculative-config\)"),
        ({}, True, r"speculative decoding \(--speculative-config\)"),
        ({"mamba_type": MambaAttentionBackendEnum.MAMBA1}, False, "MAMBA1 state layers are not supported"),
    ],
    ids=["prefix-caching-align-mode", "speculative-state-slots", "speculative-config", "mamba1"],
)
def test_hybrid_settings_whose_state_the_connector_cannot_move_are_refused_naming_the_setting(
    changes: dict[str, Any], speculative: bool, message: str
) -> None:
    cache = build_rank_cache(NEMOTRON_H, BACKENDS["FLASH_ATTN"], tp_size=2, tp_rank=1, num_blocks=NUM_BLOCKS)
    with pytest.raises(LayoutMismatch, match=message):
        rank_layout(
            NEMOTRON_H,
            _with_mamba_spec(cache.kv_cache_config, **changes),
            cache.kv_caches,
            tp_size=2,
            tp_rank=1,
            conv_layout=ConvLayout.DS,
            resolved_layout="LBHNC",
            speculative=speculative,
        )
