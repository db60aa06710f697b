"""How many blocks a KV tier holds on a vLLM engine, and the models it refuses by the field's name."""

from __future__ import annotations

import pytest
import torch
from pdconnector.vllm.config import ConnectorConfigError
from pdconnector.vllm.tier_memory import tier_slots
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)

BLOCKS, LAYERS = 10, 2
SHAPE = {"block_size": 16, "num_kv_heads": 2, "head_size": 8, "dtype": torch.float32}
FULL = FullAttentionSpec(**SHAPE)
PAGE = FULL.page_size_bytes  # one layer's block
BLOCK_BYTES = PAGE * LAYERS  # one block of every layer: what a slot holds


def cache_config(*specs: KVCacheSpec) -> KVCacheConfig:
    layers = [f"layer.{i}" for i in range(LAYERS)]
    tensor = KVCacheTensor(
        size=BLOCK_BYTES * BLOCKS, layers=layers, layer_stride=PAGE * BLOCKS, block_stride=PAGE
    )
    return KVCacheConfig(BLOCKS, [tensor], [KVCacheGroupSpec(layers, spec) for spec in specs])


def test_a_tier_holds_whole_blocks_of_every_layer_and_none_without_bytes() -> None:
    assert tier_slots(BLOCK_BYTES * 7 + 5, cache_config(FULL)) == 7
    assert tier_slots(0, cache_config(SlidingWindowSpec(**SHAPE, sliding_window=64))) == 0


def test_a_tier_too_small_for_one_block_is_refused_by_name() -> None:
    with pytest.raises(ConnectorConfigError, match=r"tier_bytes.*hold no block"):
        tier_slots(BLOCK_BYTES - 1, cache_config(FULL))


@pytest.mark.parametrize(
    ("specs", "named"),
    [
        ((SlidingWindowSpec(**SHAPE, sliding_window=64),), "SlidingWindowSpec"),
        ((FULL, MambaSpec(shapes=((4, 8),), dtypes=(torch.float32,), block_size=16)), "MambaSpec"),
    ],
)
def test_a_model_whose_kv_cache_is_not_one_group_of_full_attention_is_refused_by_name(
    specs: tuple[KVCacheSpec, ...], named: str
) -> None:
    # a sliding window's blocks come back as vLLM's null block, and SSM state is rewritten in place
    with pytest.raises(ConnectorConfigError, match=rf"tier_bytes.*one group of full attention.*{named}"):
        tier_slots(BLOCK_BYTES * 4, cache_config(*specs))
