"""From vLLM's KV cache (config + the tensors it allocated) to the layout model and registered memory regions.

The layout model (:mod:`pdconnector.layout`) predicts page sizes, groups and region sizes from the
model's HF config; vLLM decides them on its own. Everything the two must agree on is checked
here, and a disagreement stops the engine at start-up with the numbers that differ: a silent
mismatch would move bytes to the wrong places.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_cache_interface import AttentionSpec as VllmAttentionSpec
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

from pdconnector.layout import (
    AttentionLayout,
    BlockPlacement,
    ConvLayout,
    KVModel,
    LayerKind,
    RankLayout,
    model_from_hf_config,
)
from pdconnector.transport.base import Device, MemoryRegion

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class LayoutMismatch(RuntimeError):
    """vLLM's KV cache does not have the layout the connector computed; the message says what differs."""


@dataclass(frozen=True)
class CacheGroups:
    """vLLM's KV cache groups as the scheduler side needs them: which are SSM (transfer only the state
    block)."""

    num_groups: int
    ssm_groups: frozenset[int]
    block_size: int


def _layer_index(name: str) -> int:
    match = _LAYER_INDEX.search(name)
    if match is None:
        raise LayoutMismatch(f"KV cache layer {name!r} has no layer index in its name")
    return int(match.group(1))


def cache_groups(kv_cache_config: KVCacheConfig) -> CacheGroups:
    ssm = frozenset(
        g
        for g, group in enumerate(kv_cache_config.kv_cache_groups)
        if isinstance(group.kv_cache_spec, MambaSpec)
    )
    attention = [
        group.kv_cache_spec.block_size
        for group in kv_cache_config.kv_cache_groups
        if isinstance(group.kv_cache_spec, VllmAttentionSpec)
    ]
    block_size = attention[0] if attention else kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    return CacheGroups(len(kv_cache_config.kv_cache_groups), ssm, int(block_size))


# vLLM's physical orders (``KVCacheLayout`` names) the layout model describes: a page's order and where pages
# sit.
SUPPORTED_LAYOUTS: Mapping[str, tuple[AttentionLayout, BlockPlacement]] = {
    "LBHNC": (AttentionLayout.PACKED_HND, BlockPlacement.LAYER_OUTER),
    "LBNHC": (AttentionLayout.PACKED_NHD, BlockPlacement.LAYER_OUTER),
    "BLHNC": (AttentionLayout.PACKED_HND, BlockPlacement.BLOCK_OUTER),
    "BLNHC": (AttentionLayout.PACKED_NHD, BlockPlacement.BLOCK_OUTER),
    "BHLNC": (AttentionLayout.PACKED_HND, BlockPlacement.HEAD_OUTER),
}
_SUPPORTED_MAMBA_TYPES = frozenset({"MAMBA2", "GDN_ATTN"})


def check_supported(kv_cache_config: KVCacheConfig, *, speculative: bool) -> None:
    """Refuse, at start-up, the cache specs whose state the connector cannot move: a wrong transfer would be
    silent."""
    unknown = [
        type(g.kv_cache_spec).__name__
        for g in kv_cache_config.kv_cache_groups
        if not isinstance(g.kv_cache_spec, VllmAttentionSpec | MambaSpec)
    ]
    if unknown:
        raise LayoutMismatch(
            f"unsupported KV cache spec(s) {unknown}: the connector moves full attention and Mamba/GDN "
            "state only"
        )
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if not isinstance(spec, MambaSpec):
            continue
        kind = spec.mamba_type.name
        if kind not in _SUPPORTED_MAMBA_TYPES:
            raise LayoutMismatch(
                f"KV cache group {g}: {kind} state layers are not supported by PDConnector (it moves Mamba2 "
                "and GDN state)"
            )
        if spec.mamba_cache_mode != "none":
            raise LayoutMismatch(
                f"KV cache group {g}: mamba_cache_mode {spec.mamba_cache_mode!r} (vLLM sets 'align' when "
                "prefix caching is on) places SSM "
                "state blocks the connector does not model; start hybrid engines with "
                "--no-enable-prefix-caching"
            )
        if speculative or spec.num_speculative_blocks:
            raise LayoutMismatch(
                f"KV cache group {g}: speculative decoding (--speculative-config) adds Mamba state slots "
                "the connector does not move; "
                "hybrid engines cannot use it with PDConnector"
            )


def kv_buffer_device(buffer_device: str, kv_caches: Mapping[str, Any]) -> Device:
    """The memory kind to register, checked against where vLLM put the cache (``kv_buffer_device`` names
    it)."""
    tensors = all_layer_tensors(kv_caches)
    on_gpu = {t.device.type == "cuda" for t in tensors}
    if on_gpu == {True} and buffer_device != "cuda":
        raise LayoutMismatch(
            f"kv_buffer_device {buffer_device!r} but the KV cache is in GPU memory: PDConnector registers "
            "the cache itself and has no "
            "host staging; set kv_buffer_device to 'cuda'"
        )
    if on_gpu == {False} and buffer_device == "cuda":
        raise LayoutMismatch(
            "kv_buffer_device 'cuda' but the KV cache is in host memory: set kv_buffer_device to 'cpu'"
        )
    devices = {str(t.device) for t in tensors}
    if len(devices) > 1:
        raise LayoutMismatch(f"the KV cache tensors of one rank span devices {sorted(devices)}")
    return Device.VRAM if buffer_device == "cuda" else Device.DRAM


def kernel_block_size(kv_cache_config: KVCacheConfig, kv_caches: Mapping[str, Any]) -> int | None:
    """The attention kernel's block (``None`` without attention), read off the views vLLM hands connectors.

    When a backend's kernel block is smaller than the scheduler's block, vLLM views each attention layer as
    ``[num_blocks * ratio, heads, kernel_block_size, K||V]``: the bytes of a logical block are ``ratio``
    kernel blocks."""
    found: dict[int, str] = {}
    for name, block_size, tensor in _attention_views(kv_cache_config, kv_caches):
        if tensor.dim() != 4:
            continue
        blocks, tokens = int(tensor.shape[0]), int(tensor.shape[2])
        if (
            tokens <= 0
            or block_size % tokens
            or blocks != kv_cache_config.num_blocks * (block_size // tokens)
        ):
            raise LayoutMismatch(
                f"attention layer {name!r}: view {tuple(tensor.shape)} is not [num_blocks * ratio, heads, "
                "kernel block, K||V] for "
                f"{kv_cache_config.num_blocks} blocks of {block_size} tokens"
            )
        found.setdefault(tokens, name)
    if len(found) > 1:
        raise LayoutMismatch(
            f"attention layers use different kernel block sizes {sorted(found)} (e.g. "
            f"{sorted(found.values())})"
        )
    return next(iter(found), None)


def attention_layout(
    resolved: str, kv_cache_config: KVCacheConfig, kv_caches: Mapping[str, Any]
) -> tuple[AttentionLayout, BlockPlacement]:
    """The layout model's names for vLLM's resolved KV cache layout, verified against every attention view's
    strides.

    The name alone is not trusted: a backend may drop the connector's preference, and an LBNHC cache passes
    every size check while making head slices of heterogeneous TP land on the wrong bytes."""
    if resolved not in SUPPORTED_LAYOUTS:
        raise LayoutMismatch(
            f"KV cache layout {resolved} is not supported by PDConnector (it moves "
            f"{sorted(SUPPORTED_LAYOUTS)} caches): unset "
            "VLLM_KV_CACHE_LAYOUT or set it to one of those, or choose an attention backend that accepts one"
        )
    layout, placement = SUPPORTED_LAYOUTS[resolved]
    for name, _block_size, tensor in _attention_views(kv_cache_config, kv_caches):
        if layout not in _orders_of(tensor, _head_spacing(placement, kv_cache_config, name)):
            raise LayoutMismatch(
                f"attention layer {name!r}: vLLM resolved the KV cache layout to {resolved}, but its view "
                f"{tuple(tensor.shape)} has "
                f"strides {tuple(tensor.stride())}, which is not {resolved}"
            )
    return layout, placement


def _head_spacing(placement: BlockPlacement, kv_cache_config: KVCacheConfig, name: str) -> int:
    """Heads of a head-outer (BHLNC) page sit one head of every layer slot apart; elsewhere they are
    adjacent."""
    if placement is not BlockPlacement.HEAD_OUTER:
        return 1
    return next(len(g.layer_names) for g in kv_cache_config.kv_cache_groups if name in g.layer_names)


def _attention_views(
    kv_cache_config: KVCacheConfig, kv_caches: Mapping[str, Any]
) -> Iterator[tuple[str, int, torch.Tensor]]:
    """(layer name, scheduler block size, first view) of every attention layer vLLM handed a cache for."""
    for group in kv_cache_config.kv_cache_groups:
        if isinstance(group.kv_cache_spec, VllmAttentionSpec):
            for name in group.layer_names:
                if name in kv_caches:
                    yield name, int(group.kv_cache_spec.block_size), layer_tensors(kv_caches[name])[0]


def _orders_of(view: torch.Tensor, head_spacing: int = 1) -> set[AttentionLayout]:
    """The in-block orders a ``[blocks, heads, tokens, K||V]`` view's strides fit (both when heads or tokens
    is 1);
    ``head_spacing``: head-major heads sit that many heads apart (the layer slots of a head-outer block)."""
    _, heads, tokens, channels = (int(d) for d in view.shape)
    _, head_stride, token_stride, channel_stride = view.stride()
    orders = set()
    if (
        channel_stride == 1
        and (heads == 1 or head_stride == head_spacing * tokens * channels)
        and (tokens == 1 or token_stride == channels)
    ):
        orders.add(AttentionLayout.PACKED_HND)
    if (
        channel_stride == 1
        and (tokens == 1 or token_stride == heads * channels)
        and (heads == 1 or head_stride == channels)
    ):
        orders.add(AttentionLayout.PACKED_NHD)
    return orders


def model_spec(
    hf_config: Mapping[str, Any],
    kv_cache_config: KVCacheConfig,
    *,
    conv_layout: ConvLayout,
    kernel_block_size: int | None = None,
    attention_layout: AttentionLayout = AttentionLayout.PACKED_HND,
) -> KVModel:
    """The layout model of the served model, with dtypes and block size taken from vLLM's own cache specs
    (attention from the attention spec, conv and temporal state from the Mamba spec: an fp8 KV cache keeps
    them wide)."""
    attention = [
        g.kv_cache_spec
        for g in kv_cache_config.kv_cache_groups
        if isinstance(g.kv_cache_spec, VllmAttentionSpec)
    ]
    mamba = [
        g.kv_cache_spec for g in kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)
    ]
    spec = attention[0] if attention else mamba[0]
    return model_from_hf_config(
        hf_config,
        dtype_bytes=attention[0].dtype.itemsize if attention else mamba[0].dtypes[0].itemsize,
        ssm_conv_dtype_bytes=mamba[0].dtypes[0].itemsize if mamba else None,
        ssm_state_dtype_bytes=mamba[0].dtypes[-1].itemsize if mamba else None,
        block_size=int(spec.block_size),
        kernel_block_size=kernel_block_size,
        attention_layout=attention_layout,
        conv_layout=conv_layout,
    )


def rank_layout(
    hf_config: Mapping[str, Any],
    kv_cache_config: KVCacheConfig,
    kv_caches: Mapping[str, Any],
    *,
    tp_size: int,
    tp_rank: int,
    conv_layout: ConvLayout,
    resolved_layout: str,
    speculative: bool = False,
) -> RankLayout:
    """This rank's layout as the tensors vLLM allocated show it, refused with a reason unless the connector
    can move it: supported specs, the resolved layout and the views' strides, kernel blocks, HMA groups and
    page sizes."""
    check_supported(kv_cache_config, speculative=speculative)
    page_order, placement = attention_layout(resolved_layout, kv_cache_config, kv_caches)
    model = model_spec(
        hf_config,
        kv_cache_config,
        conv_layout=conv_layout,
        kernel_block_size=kernel_block_size(kv_cache_config, kv_caches),
        attention_layout=page_order,
    )
    try:
        layout = RankLayout(model, tp_size, tp_rank, kv_cache_config.num_blocks, placement)
    except ValueError as error:
        raise LayoutMismatch(f"KV cache layout {resolved_layout}: {error}") from None
    check_groups(layout, kv_cache_config)
    return layout


def check_groups(layout: RankLayout, kv_cache_config: KVCacheConfig) -> None:
    """vLLM's groups hold the same layers, in the same order, as the layout model's (HMA grouping)."""
    names = sorted(
        (name for g in kv_cache_config.kv_cache_groups for name in g.layer_names), key=_layer_index
    )
    position = {name: i for i, name in enumerate(names)}
    if len(names) != len(layout.model.layers):
        raise LayoutMismatch(
            f"vLLM has {len(names)} KV cache layers, the model config describes {len(layout.model.layers)}"
        )
    theirs = [[position[name] for name in g.layer_names] for g in kv_cache_config.kv_cache_groups]
    ours = [list(g.layers) for g in layout.groups]
    if theirs != ours:
        raise LayoutMismatch(f"KV cache groups differ: vLLM {theirs}, layout model {ours}")
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        page = group.kv_cache_spec.page_size_bytes
        if page != layout.page_bytes:
            raise LayoutMismatch(
                f"KV cache group {g}: vLLM page of {page} B, the layout model computes {layout.page_bytes} B"
            )


def layer_tensors(value: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A layer's KV cache tensors as vLLM registers them (one tensor, or several views of one page)."""
    return [value] if isinstance(value, torch.Tensor) else list(value)


def all_layer_tensors(kv_caches: Mapping[str, Any]) -> list[torch.Tensor]:
    """Every layer's KV cache tensors, in registration order."""
    return [tensor for value in kv_caches.values() for tensor in layer_tensors(value)]


def memory_regions(
    layout: RankLayout, kv_cache_config: KVCacheConfig, kv_caches: Mapping[str, Any], device: Device
) -> list[MemoryRegion]:
    """The layout's regions at their addresses in vLLM's buffer, checked against where every layer's views
    start."""
    names = sorted(
        (name for g in kv_cache_config.kv_cache_groups for name in g.layer_names), key=_layer_index
    )
    bases: dict[int, int] = {}
    for position, name in enumerate(names):
        if name not in kv_caches:
            raise LayoutMismatch(f"vLLM registered no KV cache tensor for layer {name!r}")
        tensors = layer_tensors(kv_caches[name])
        base = min(t.data_ptr() for t in tensors)
        slot, kind = layout.layer_slots[position], layout.model.layers[position]
        first = np.zeros(1, dtype=np.int64)
        # where block 0 of the slot's page starts
        regions, starts = layout.locate(kind, np.array([slot]), first, first)
        region, start = int(regions.flat[0]), int(starts.flat[0])
        if bases.setdefault(region, base - start) != base - start:
            raise LayoutMismatch(
                f"layer {name!r} (slot {slot}) starts at {base:#x}; region {region} starts at "
                f"{bases[region]:#x}, so the layout "
                f"model expects {bases[region] + start:#x}"
            )
        _check_layer_tensors(layout, name, kind, tensors, base)
    device_id = layer_tensors(kv_caches[names[0]])[0].device.index or 0
    return [MemoryRegion(bases[r.index], r.nbytes, device, device_id) for r in layout.regions]


def _check_layer_tensors(
    layout: RankLayout, name: str, kind: LayerKind, tensors: list[torch.Tensor], base: int
) -> None:
    """Attention: kernel blocks of ``physical_page_bytes``. SSM: pages of ``page_bytes`` whose state tensors
    (conv then temporal, or one raw byte view of both) cover exactly the first ``ssm_state_bytes`` of each
    page."""
    outer = layout.placement is not BlockPlacement.LAYER_OUTER
    if kind is LayerKind.ATTENTION:
        stride = layout.block_stride if outer else layout.physical_page_bytes
        blocks, extent = (
            layout.num_blocks * layout.model.physical_blocks_per_logical,
            layout.physical_page_bytes,
        )
    else:
        stride, blocks, extent = layout.block_stride, layout.num_blocks, layout.ssm_state_bytes
    spans = sorted((t.data_ptr() - base, t[0].numel() * t.element_size()) for t in tensors)
    covered = 0
    for offset, size in spans:
        covered = offset + size if offset == covered else -1
    got = [(t.data_ptr() - base, t.stride(0) * t.element_size(), t.shape[0]) for t in tensors]
    if covered != extent or any(g[1:] != (stride, blocks) for g in got):
        raise LayoutMismatch(
            f"{kind} layer {name!r}: vLLM tensors {[tuple(t.shape) for t in tensors]} have (offset, block "
            f"stride, blocks) {got} covering "
            f"{spans} of each block; the layout model expects block stride {stride}, {blocks} blocks, bytes "
            f"[0, {extent}) covered"
        )
