"""vLLM 0.32's KV caches as its GPU model runner builds them, built on the CPU with vLLM's own functions.

The runner (``gpu_model_runner.py`` ``initialize_kv_cache``) takes every layer's spec (attention specs
customised by the backend, ``customize_attention_spec``), groups them and sizes the pool
(``kv_cache_utils.get_kv_cache_groups`` and ``get_kv_cache_config_from_groups``, the per-worker half of
``get_kv_cache_configs``), picks a kernel block per group (``prepare_kernel_block_sizes`` ->
``select_common_block_size``) and views one raw int8 buffer per layer (``allocate_kv_cache`` ->
``create_kv_cache_views``). Those views are what the connector's ``register_kv_caches`` receives; the
attention kernels and the Mamba mixers reinterpret them as below. Only the device differs: CPU memory, so the
tests can plant and read bytes.

Values are planted as integer tags of what a byte *is* (layer, global head or channel, token, K/V, channel),
so a transfer that misplaces anything reads back a different tag.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from pdconnector.layout import ConvLayout, LayerKind, RankLayout
from pdconnector.transport.base import MemoryRegion
from pdconnector.vllm.kv_layout import kv_buffer_device, memory_regions, rank_layout
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    get_conv_state_layout,
)
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.backends.utils import (
    get_flashinfer_layout_string,
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import (
    AttentionGroup,
    allocate_kv_cache,
    customize_attention_spec,
    prepare_kernel_block_sizes,
)

# Byte every decode buffer starts as: whatever a transfer does not write must still read this.
SENTINEL = 0x5A
# Byte every prefill buffer starts as, so bytes copied from outside the planted tokens still differ from
# SENTINEL.
PREFILL_FILL = 0x11
# Mamba's block size without prefix caching is max_model_len (models/config.py MambaModelConfig); any value
# does.
MAX_MODEL_LEN = 8192

QWEN3_32B: Mapping[str, Any] = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "num_hidden_layers": 64,
    "hidden_size": 5120,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
}

# Nemotron-H 8B's mixer sizes over a 14-layer pattern (6 Mamba2, 2 attention, 6 MLP): three Mamba groups and
# one attention group over two shared regions, the HMA shape of the full model at a fraction of its memory.
NEMOTRON_H: Mapping[str, Any] = {
    "model_type": "nemotron_h",
    "architectures": ["NemotronHForCausalLM"],
    "hybrid_override_pattern": "M-M-M*-M-M-M*-",
    "num_hidden_layers": 14,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "mamba_ssm_cache_dtype": "float32",
    "torch_dtype": "bfloat16",
}


# Nemotron-3-Super-120B's attention (2 KV heads of 128) over the mixers above: at TP 4 and 8 every rank holds
# one replicated KV head next to its shard of the SSM state.
NEMOTRON_H_TWO_KV_HEADS: Mapping[str, Any] = {**NEMOTRON_H, "num_key_value_heads": 2}


class FlashInferConstraints:
    """What of FlashInfer's backend class the cache build consults, restated from
    ``vllm/v1/attention/backends/flashinfer.py`` because the ``flashinfer`` package (which that module
    imports) is not installed here. Before SM100 (Hopper and older):

    - kernel blocks of 16, 32 or 64 tokens only (``get_supported_kernel_block_sizes``, ~460-479; 128+ only on
      SM100 with trtllm-gen), so a larger scheduler block is split into kernel blocks;
    - no layout restriction (``supported_kv_cache_layouts`` returns the base class's ``None``, ~604-610; on
      SM100 it is ``(LBHNC, BLHNC)``);
    - the spec is repacked only for NVFP4 caches (``customize_spec``, ~433-446).
    """

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: KVCacheSpec | None = None) -> list[int | MultipleOf]:
        return [16, 32, 64]

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        return spec

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...] | None:
        return None


KernelKV = Callable[[torch.Tensor, KVCacheLayout, int], tuple[torch.Tensor, torch.Tensor]]


def _flash_attn_kv(
    cache: torch.Tensor, layout: KVCacheLayout, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # flash_attn.py:1252 (forward) and triton_attn.py:796 (do_kv_cache_update), :625 (forward):
    # (B, H, N, 2*D) -> ((B, N, H, D), (B, N, H, D)), whatever the physical order.
    key, value = cache.transpose(1, 2).split(head_size, dim=-1)
    return key, value


def _flashinfer_kv(
    cache: torch.Tensor, layout: KVCacheLayout, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # flashinfer.py:2135-2168: permute the logical view into physical order, split K||V, and tell the kernel
    # that order
    # (get_flashinfer_layout_string: HND = [B, H, N, D], NHD = [B, N, H, D]). Returned here as [B, N, H, D]
    # for indexing.
    key, value = cache.permute(*layout.layer_view_order).split(head_size, dim=-1)
    if get_flashinfer_layout_string(layout) == "HND":
        return key.transpose(1, 2), value.transpose(1, 2)
    return key, value


@dataclass(frozen=True)
class Backend:
    """An attention backend as the cache build sees it (its class) and as its kernels read a cache view."""

    name: str
    cls: type
    kernel_kv: KernelKV


BACKENDS: Mapping[str, Backend] = {
    "FLASH_ATTN": Backend("FLASH_ATTN", FlashAttentionBackend, _flash_attn_kv),
    "TRITON_ATTN": Backend("TRITON_ATTN", TritonAttentionBackend, _flash_attn_kv),
    "FLASHINFER": Backend("FLASHINFER", FlashInferConstraints, _flashinfer_kv),
}


@dataclass(frozen=True)
class Layer:
    index: int
    name: str
    kind: LayerKind


def model_layers(hf_config: Mapping[str, Any]) -> list[Layer]:
    """The KV-holding layers under vLLM's module names (nemotron_h.py: ``layers.i.mixer`` /
    ``layers.i.mixer.attn``)."""
    pattern = hf_config.get("hybrid_override_pattern")
    if pattern is None:
        return [
            Layer(i, f"model.layers.{i}.self_attn.attn", LayerKind.ATTENTION)
            for i in range(hf_config["num_hidden_layers"])
        ]
    codes = {"M": (".mixer", LayerKind.SSM), "*": (".mixer.attn", LayerKind.ATTENTION)}
    return [
        Layer(i, f"model.layers.{i}{codes[c][0]}", codes[c][1]) for i, c in enumerate(pattern) if c in codes
    ]


def _kv_heads_per_rank(hf_config: Mapping[str, Any], tp_size: int) -> int:
    # Qwen3Attention / NemotronHAttention: above the KV head count every rank holds one replicated head.
    return max(1, hf_config["num_key_value_heads"] // tp_size)


def _attention_spec(
    hf_config: Mapping[str, Any], tp_size: int, block_size: int, backend: Backend
) -> AttentionSpec:
    # Attention.get_kv_cache_spec, then the runner's customize_attention_spec (gpu_model_runner.py
    # get_kv_cache_spec).
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=_kv_heads_per_rank(hf_config, tp_size),
        head_size=hf_config["head_dim"],
        dtype=torch.bfloat16,
    )
    return customize_attention_spec(backend.cls, spec)


def _mamba_state(
    hf_config: Mapping[str, Any], tp_size: int
) -> tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]]:
    # NemotronHForCausalLM.get_mamba_state_shape_from_config / MambaMixer2.get_state_dtype.
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=tp_size,
        intermediate_size=hf_config["mamba_num_heads"] * hf_config["mamba_head_dim"],
        n_groups=hf_config["n_groups"],
        num_heads=hf_config["mamba_num_heads"],
        head_dim=hf_config["mamba_head_dim"],
        state_size=hf_config["ssm_state_size"],
        conv_kernel=hf_config["conv_kernel"],
    )
    dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(
        torch.bfloat16, "auto", hf_config["mamba_ssm_cache_dtype"]
    )
    return shapes, dtypes


def hybrid_block_size(hf_config: Mapping[str, Any], tp_size: int, backend: Backend) -> tuple[int, int | None]:
    """vLLM's block size and padded Mamba page for a hybrid model: ``Platform._align_hybrid_block_size``
    (platforms/interface.py ~939-1126) restated, since it needs a loaded model class. The smallest multiple of
    the backend's smallest kernel block whose attention page holds the Mamba state; the Mamba page is padded
    to it."""
    per_token = _attention_spec(hf_config, tp_size, 1, backend).page_size_bytes
    shapes, dtypes = _mamba_state(hf_config, tp_size)
    mamba_page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    sizes = backend.cls.get_supported_kernel_block_sizes()
    alignment = max(
        min(s.base if isinstance(s, MultipleOf) else s for s in sizes), CacheConfig.DEFAULT_BLOCK_SIZE
    )
    # One attention backend: the second rounding, to every backend's smallest kernel block, changes nothing.
    block_size = alignment * math.ceil(mamba_page / (alignment * per_token))
    return block_size, (block_size * per_token if block_size * per_token != mamba_page else None)


def layer_specs(hf_config: Mapping[str, Any], tp_size: int, backend: Backend) -> dict[str, KVCacheSpec]:
    """Every layer's spec, in module order, as the runner's ``get_kv_cache_spec`` returns them."""
    layers = model_layers(hf_config)
    if not any(layer.kind is LayerKind.SSM for layer in layers):
        # The default block, which every backend here takes (update_block_size_for_backend keeps it).
        return {
            layer.name: _attention_spec(hf_config, tp_size, CacheConfig.DEFAULT_BLOCK_SIZE, backend)
            for layer in layers
        }
    block_size, padded = hybrid_block_size(hf_config, tp_size, backend)
    shapes, dtypes = _mamba_state(hf_config, tp_size)
    # MambaBase.get_kv_cache_spec without prefix caching or speculative decoding.
    mamba = MambaSpec(
        shapes=shapes,
        dtypes=dtypes,
        block_size=MAX_MODEL_LEN,
        page_size_padded=padded,
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
    )
    attention = _attention_spec(hf_config, tp_size, block_size, backend)
    return {layer.name: attention if layer.kind is LayerKind.ATTENTION else mamba for layer in layers}


def engine_config(num_blocks: int) -> VllmConfig:
    """A model-less VllmConfig carrying what the cache build reads: the pool size and the KV connector (ours,
    whose ``get_required_kvcache_layout`` the layout resolution consults)."""
    kv_transfer = KVTransferConfig(
        kv_connector="PDConnector", kv_connector_module_path="pdconnector.vllm.connector", kv_role="kv_both"
    )
    return VllmConfig(
        cache_config=CacheConfig(num_gpu_blocks_override=num_blocks), kv_transfer_config=kv_transfer
    )


@dataclass
class RankCache:
    """One TP rank's KV cache exactly as vLLM allocated it (here in host memory)."""

    hf_config: Mapping[str, Any]
    backend: Backend
    tp_size: int
    tp_rank: int
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    kernel_block_sizes: list[int]
    attn_groups: list[list[AttentionGroup]]
    kv_caches: dict[str, torch.Tensor]

    @property
    def layout(self) -> KVCacheLayout:
        return self.vllm_config.cache_config.get_resolved_kv_cache_layout()

    @property
    def raw(self) -> torch.Tensor:
        """The one backing int8 buffer every view aliases."""
        storage = next(iter(self.kv_caches.values())).untyped_storage()
        return torch.empty(0, dtype=torch.int8).set_(storage, 0, (storage.nbytes(),))

    def layers(self) -> list[Layer]:
        return model_layers(self.hf_config)

    def group_of(self, name: str) -> int:
        return next(
            g for g, group in enumerate(self.kv_cache_config.kv_cache_groups) if name in group.layer_names
        )

    def rank_layout(self, *, resolved_layout: str | None = None) -> RankLayout:
        """What the connector's ``register_kv_caches`` computes for this rank."""
        return rank_layout(
            self.hf_config,
            self.kv_cache_config,
            self.kv_caches,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            conv_layout=ConvLayout(get_conv_state_layout()),
            resolved_layout=resolved_layout or self.layout.name,
        )

    def memory_regions(self, layout: RankLayout, buffer_device: str = "cpu") -> list[MemoryRegion]:
        """The regions ``register_kv_caches`` registers, for the memory kind ``kv_buffer_device`` names."""
        return memory_regions(
            layout, self.kv_cache_config, self.kv_caches, kv_buffer_device(buffer_device, self.kv_caches)
        )

    def kernel_blocks(self, group: int, blocks: Sequence[int]) -> torch.Tensor:
        """The kernel blocks of an attention group's blocks, as the attention metadata maps its block table
        (``AttentionGroup.map_to_kernel_block_table``)."""
        table = torch.tensor([list(blocks)], dtype=torch.int32)
        return self.attn_groups[group][0].map_to_kernel_block_table(table)[0].long()

    def token_slots(
        self, group: int, blocks: Sequence[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernel block, offset) of each of a request's tokens: ``slot = kernel block * kernel_block_size +
        offset``."""
        kernel_block_size = self.kernel_block_sizes[group]
        positions = torch.arange(num_tokens)
        return self.kernel_blocks(group, blocks)[
            positions // kernel_block_size
        ], positions % kernel_block_size

    def kernel_kv(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of an attention layer as the backend's kernels read them, [kernel block, token, head,
        channel]."""
        return self.backend.kernel_kv(self.kv_caches[name], self.layout, self.hf_config["head_dim"])

    def mamba_states(self, name: str) -> tuple[torch.Tensor, ...]:
        """(conv, temporal) state of a Mamba layer as its mixer reads them: ``MambaBase.bind_kv_cache`` on the
        raw page view, with the mixer's state shapes and dtypes (mamba_mixer2.py ~744-749 uses
        ``kv_cache[0]``, ``[1]``)."""
        shapes, dtypes = _mamba_state(self.hf_config, self.tp_size)
        mixer = SimpleNamespace(get_state_shape=lambda: shapes, get_state_dtype=lambda: dtypes)
        MambaBase.bind_kv_cache(mixer, self.kv_caches[name])  # type: ignore[arg-type]
        return mixer.kv_cache


def build_rank_cache(
    hf_config: Mapping[str, Any], backend: Backend, *, tp_size: int, tp_rank: int, num_blocks: int
) -> RankCache:
    """Allocate one rank's cache the way ``GPUModelRunner.initialize_kv_cache`` does, in host memory.

    The layout is resolved as the engine core resolves it: ``VLLM_KV_CACHE_LAYOUT`` if set, else our
    connector's required layout, within what the backend and the specs allow (``resolve_kv_cache_layout``)."""
    vllm_config = engine_config(num_blocks)
    specs = layer_specs(hf_config, tp_size, backend)
    supported = [layout.name for layout in get_supported_kv_cache_layouts([backend.cls])]
    layout = resolve_kv_cache_layout(vllm_config, [supported], specs.values())
    groups = get_kv_cache_groups(vllm_config, specs)
    # num_gpu_blocks_override sets num_blocks whatever the memory (may_override_num_blocks).
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, groups, available_memory=0)
    attn_groups = [
        [AttentionGroup(backend.cls, group.layer_names, group.kv_cache_spec, g)]
        if isinstance(group.kv_cache_spec, AttentionSpec)
        else []
        for g, group in enumerate(kv_cache_config.kv_cache_groups)
    ]
    kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, attn_groups)
    for g, groups_of_g in enumerate(attn_groups):
        for group in groups_of_g:
            _map_to_kernel_blocks(group, kernel_block_sizes[g], num_blocks)
    kv_caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, kernel_block_sizes)
    return RankCache(
        hf_config,
        backend,
        tp_size,
        tp_rank,
        vllm_config,
        kv_cache_config,
        kernel_block_sizes,
        attn_groups,
        kv_caches,
    )


def _map_to_kernel_blocks(group: AttentionGroup, kernel_block_size: int, num_blocks: int) -> None:
    """The kernel block table state ``AttentionGroup.create_metadata_builders`` sets up (worker/utils.py
    ~292-329), without the backend's metadata builders."""
    ratio = group.kv_cache_spec.block_size // kernel_block_size
    if ratio == 1:
        return
    group.kernel_block_size = kernel_block_size
    group.kernel_block_table = torch.zeros(1, 1, num_blocks * ratio, dtype=torch.int32)
    group.kernel_block_offsets = torch.arange(ratio, dtype=torch.int32)


# --- planted values -----------------------------------------------------------------------------------------


def tag(dtype: torch.dtype, *fields: torch.Tensor | int) -> torch.Tensor:
    """A hash of the (broadcast) fields as integers of ``dtype``: what the byte at those coordinates must
    hold."""
    h = torch.zeros((), dtype=torch.int64)
    for value in fields:
        h = ((h ^ torch.as_tensor(value, dtype=torch.int64)) * 1_000_003) & 0x7FFFFFFF
        h = h ^ (h >> 15)
    bits = torch.iinfo(dtype).bits
    return ((h & ((1 << bits) - 1)) - (1 << (bits - 1))).to(dtype)


def as_int(tensor: torch.Tensor) -> torch.Tensor:
    """The same elements as raw integers (bf16 -> int16, fp32 -> int32), so tags survive any float pattern."""
    return tensor.view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


@dataclass(frozen=True)
class Request:
    """A request's logical block ids per KV cache group (vLLM's order) and its prompt length."""

    blocks: tuple[tuple[int, ...], ...]
    num_tokens: int


def scattered_request(cache: RankCache, num_tokens: int, seed: int) -> Request:
    """Non-contiguous, shuffled block ids: each attention group gets the blocks ``num_tokens`` needs, each
    Mamba group its one state block (no prefix caching); no id is shared, as vLLM's block pool never hands one
    out twice."""
    ids = iter(np.random.default_rng(seed).permutation(cache.kv_cache_config.num_blocks).tolist())
    blocks = []
    for group in cache.kv_cache_config.kv_cache_groups:
        count = (
            math.ceil(num_tokens / group.kv_cache_spec.block_size)
            if isinstance(group.kv_cache_spec, AttentionSpec)
            else 1
        )
        blocks.append(tuple(next(ids) for _ in range(count)))
    return Request(tuple(blocks), num_tokens)


def _attention_tags(cache: RankCache, layer: Layer, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[token, local head, channel] tags of K and V: f(layer, global kv head, position, K/V, channel)."""
    heads = _kv_heads_per_rank(cache.hf_config, cache.tp_size)
    # QKVParallelLinear: rank r loads KV shard r // replicas, replicas = tp / heads once TP exceeds them.
    replicas = max(1, cache.tp_size // cache.hf_config["num_key_value_heads"])
    global_heads = (cache.tp_rank // replicas * heads + torch.arange(heads))[None, :, None]
    positions, channels = (
        torch.arange(num_tokens)[:, None, None],
        torch.arange(cache.hf_config["head_dim"])[None, None, :],
    )
    key, value = (tag(torch.int16, layer.index, global_heads, positions, kv, channels) for kv in (0, 1))
    return key, value


def _conv_channels(cache: RankCache) -> torch.Tensor:
    """Global conv channel of each local DS row: the rank's x, B, C shards in that order (mamba_mixer2.py
    ~346-356, conv1d as MergedColumnParallelLinear of [intermediate, n_groups * state, n_groups * state], each
    split by TP)."""
    c, tp, rank = cache.hf_config, cache.tp_size, cache.tp_rank
    inner, groups = c["mamba_num_heads"] * c["mamba_head_dim"], c["n_groups"] * c["ssm_state_size"]
    starts = (0, inner, inner + groups)
    return torch.cat(
        [
            start + rank * size // tp + torch.arange(size // tp)
            for start, size in zip(starts, (inner, groups, groups), strict=True)
        ]
    )


def _mamba_tags(cache: RankCache, layer: Layer) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv state tags f(layer, global conv channel, row) and temporal tags f(layer, global head, head dim,
    state)."""
    (_, rows), (heads, head_dim, state) = _mamba_state(cache.hf_config, cache.tp_size)[0]
    conv = tag(torch.int16, layer.index, 0, _conv_channels(cache)[:, None], torch.arange(rows)[None, :])
    global_heads = (cache.tp_rank * heads + torch.arange(heads))[:, None, None]
    temporal = tag(
        torch.int32,
        layer.index,
        1,
        global_heads,
        torch.arange(head_dim)[None, :, None],
        torch.arange(state)[None, None, :],
    )
    return conv, temporal


def plant(cache: RankCache, request: Request) -> None:
    """Write the request's K/V (through the attention kernels' views) and Mamba state (through the mixers'
    views)."""
    for layer in cache.layers():
        g = cache.group_of(layer.name)
        if layer.kind is LayerKind.ATTENTION:
            blocks, offsets = cache.token_slots(g, request.blocks[g], request.num_tokens)
            for view, tags in zip(
                cache.kernel_kv(layer.name), _attention_tags(cache, layer, request.num_tokens), strict=True
            ):
                as_int(view)[blocks, offsets] = tags
        else:
            for view, tags in zip(cache.mamba_states(layer.name), _mamba_tags(cache, layer), strict=True):
                as_int(view)[request.blocks[g][0]] = tags


def arrived(cache: RankCache, request: Request) -> list[str]:
    """The layers and states of a decode rank that do not hold, for its own heads and channels, what prefill
    planted."""
    wrong = []
    for layer in cache.layers():
        g = cache.group_of(layer.name)
        if layer.kind is LayerKind.ATTENTION:
            blocks, offsets = cache.token_slots(g, request.blocks[g], request.num_tokens)
            got = [as_int(view)[blocks, offsets] for view in cache.kernel_kv(layer.name)]
            expected = _attention_tags(cache, layer, request.num_tokens)
            labels = ("K", "V")
        else:
            got = [as_int(view)[request.blocks[g][0]] for view in cache.mamba_states(layer.name)]
            expected = _mamba_tags(cache, layer)
            labels = ("conv state", "temporal state")
        wrong += [
            f"{layer.name} {label}"
            for label, a, b in zip(labels, got, expected, strict=True)
            if not torch.equal(a, b)
        ]
    return wrong


def clear_request(cache: RankCache, request: Request) -> None:
    """Reset to SENTINEL every byte vLLM's views give the request: its attention blocks' kernel pages (all
    tokens) and its Mamba blocks' states (not the HMA padding behind them). Whatever else differs from
    SENTINEL was written outside."""
    for layer in cache.layers():
        g = cache.group_of(layer.name)
        if layer.kind is LayerKind.ATTENTION:
            pages = [
                cache.kv_caches[layer.name][b] for b in cache.kernel_blocks(g, request.blocks[g]).tolist()
            ]
        else:
            pages = [state[request.blocks[g][0]] for state in cache.mamba_states(layer.name)]
        for page in pages:
            page.view(torch.int8).fill_(SENTINEL)


def copy_descriptors(src: RankCache, dst: RankCache, src_descs: np.ndarray, dst_descs: np.ndarray) -> None:
    """Do what NIXL would: copy each descriptor's bytes, by address, from the prefill buffer into the decode
    buffer."""
    src_raw, dst_raw = src.raw, dst.raw
    src_bytes, dst_bytes = src_raw.numpy(), dst_raw.numpy()
    src_base, dst_base = src_raw.data_ptr(), dst_raw.data_ptr()
    for (src_addr, length, _), (dst_addr, _, _) in zip(src_descs.tolist(), dst_descs.tolist(), strict=True):
        src_at, dst_at = src_addr - src_base, dst_addr - dst_base
        assert 0 <= src_at <= src_bytes.size - length, (
            f"source descriptor [{src_addr:#x}, {length}] outside the prefill buffer"
        )
        assert 0 <= dst_at <= dst_bytes.size - length, (
            f"destination descriptor [{dst_addr:#x}, {length}] outside the decode buffer"
        )
        dst_bytes[dst_at : dst_at + length] = src_bytes[src_at : src_at + length]
