"""From vLLM's KV cache (config + the tensors it allocated) to the layout model and registered memory regions.

The layout model (:mod:`pdconnector.layout`) predicts page sizes, groups and region sizes from the
model's HF config; vLLM decides them on its own. Everything the two must agree on is checked
here, and a disagreement stops the engine at start-up with the numbers that differ: a silent
mismatch would move bytes to the wrong places.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.kv_cache_interface import AttentionSpec as VllmAttentionSpec
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

from pdconnector.layout import ConvLayout, LayerKind, ModelSpec, RankLayout, model_from_hf_config
from pdconnector.transport.base import Device, MemoryRegion

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class LayoutMismatch(RuntimeError):
    """vLLM's KV cache does not have the layout the connector computed; the message says what differs."""


@dataclass(frozen=True)
class CacheGroups:
    """vLLM's KV cache groups as the scheduler side needs them: which are SSM (transfer only the state block)."""

    num_groups: int
    ssm_groups: frozenset[int]
    block_size: int


def _layer_index(name: str) -> int:
    match = _LAYER_INDEX.search(name)
    if match is None:
        raise LayoutMismatch(f"KV cache layer {name!r} has no layer index in its name")
    return int(match.group(1))


def cache_groups(kv_cache_config: KVCacheConfig) -> CacheGroups:
    ssm = frozenset(g for g, group in enumerate(kv_cache_config.kv_cache_groups) if isinstance(group.kv_cache_spec, MambaSpec))
    attention = [group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups if isinstance(group.kv_cache_spec, VllmAttentionSpec)]
    block_size = attention[0] if attention else kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    return CacheGroups(len(kv_cache_config.kv_cache_groups), ssm, int(block_size))


def model_spec(
    hf_config: Mapping[str, Any], kv_cache_config: KVCacheConfig, *, conv_layout: ConvLayout, kernel_block_size: int | None = None
) -> ModelSpec:
    """The layout model of the served model, with dtypes and block size taken from vLLM's own cache specs."""
    attention = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, VllmAttentionSpec)]
    mamba = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]
    unknown = [
        type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups if not isinstance(g.kv_cache_spec, VllmAttentionSpec | MambaSpec)
    ]
    if unknown:
        raise LayoutMismatch(f"unsupported KV cache spec(s) {unknown}: the connector moves full attention and Mamba/GDN state only")
    spec = attention[0] if attention else mamba[0]
    dtype_bytes = spec.dtype.itemsize if attention else mamba[0].dtypes[0].itemsize
    state_bytes = mamba[0].dtypes[-1].itemsize if mamba else None
    return model_from_hf_config(
        hf_config,
        dtype_bytes=dtype_bytes,
        ssm_state_dtype_bytes=state_bytes,
        block_size=int(spec.block_size),
        kernel_block_size=kernel_block_size,
        conv_layout=conv_layout,
    )


def check_groups(layout: RankLayout, kv_cache_config: KVCacheConfig) -> None:
    """vLLM's groups hold the same layers, in the same order, as the layout model's (HMA grouping)."""
    names = sorted((name for g in kv_cache_config.kv_cache_groups for name in g.layer_names), key=_layer_index)
    position = {name: i for i, name in enumerate(names)}
    if len(names) != len(layout.model.layers):
        raise LayoutMismatch(f"vLLM has {len(names)} KV cache layers, the model config describes {len(layout.model.layers)}")
    theirs = [[position[name] for name in g.layer_names] for g in kv_cache_config.kv_cache_groups]
    ours = [list(g.layers) for g in layout.groups]
    if theirs != ours:
        raise LayoutMismatch(f"KV cache groups differ: vLLM {theirs}, layout model {ours}")
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        page = group.kv_cache_spec.page_size_bytes
        if page != layout.page_bytes:
            raise LayoutMismatch(f"KV cache group {g}: vLLM page of {page} B, the layout model computes {layout.page_bytes} B")


def _tensors(value: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


def memory_regions(layout: RankLayout, kv_cache_config: KVCacheConfig, kv_caches: Mapping[str, Any], device: Device) -> list[MemoryRegion]:
    """One region per layer slot, at the address of the slot's pages in vLLM's buffer, checked against every layer using it."""
    names = sorted((name for g in kv_cache_config.kv_cache_groups for name in g.layer_names), key=_layer_index)
    bases: dict[int, int] = {}
    for position, name in enumerate(names):
        if name not in kv_caches:
            raise LayoutMismatch(f"vLLM registered no KV cache tensor for layer {name!r}")
        tensors = _tensors(kv_caches[name])
        base = min(t.data_ptr() for t in tensors)
        region = layout.layer_regions[position]
        if bases.setdefault(region, base) != base:
            raise LayoutMismatch(f"layer {name!r} starts at {base:#x}, other layers of region {region} at {bases[region]:#x}")
        _check_layer_tensors(layout, name, layout.model.layers[position], tensors, base)
    return [MemoryRegion(bases[r.index], r.nbytes, device, _device_index(kv_caches)) for r in layout.regions]


def _check_layer_tensors(layout: RankLayout, name: str, kind: LayerKind, tensors: list[torch.Tensor], base: int) -> None:
    """Attention: kernel blocks of ``physical_page_bytes``. SSM: pages of ``page_bytes`` whose state tensors (conv then
    temporal, or one raw byte view of both) cover exactly the first ``ssm_state_bytes`` of each page."""
    if kind is LayerKind.ATTENTION:
        stride, blocks, extent = layout.physical_page_bytes, layout.num_blocks * layout.model.physical_blocks_per_logical, layout.physical_page_bytes
    else:
        stride, blocks, extent = layout.page_bytes, layout.num_blocks, layout.ssm_state_bytes
    spans = sorted((t.data_ptr() - base, t[0].numel() * t.element_size()) for t in tensors)
    covered = 0
    for offset, size in spans:
        covered = offset + size if offset == covered else -1
    got = [(t.data_ptr() - base, t.stride(0) * t.element_size(), t.shape[0]) for t in tensors]
    if covered != extent or any(g[1:] != (stride, blocks) for g in got):
        raise LayoutMismatch(
            f"{kind} layer {name!r}: vLLM tensors {[tuple(t.shape) for t in tensors]} have (offset, block stride, blocks) {got} covering "
            f"{spans} of each block; the layout model expects block stride {stride}, {blocks} blocks, bytes [0, {extent}) covered"
        )


def _device_index(kv_caches: Mapping[str, Any]) -> int:
    first = _tensors(next(iter(kv_caches.values())))[0]
    return first.device.index or 0
