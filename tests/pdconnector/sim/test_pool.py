"""The KV pools: block allocator, and memory laid out by the connector core's layout on every TP rank."""

from __future__ import annotations

import pytest
from pdconnector.sim.model import generate, prefill
from pdconnector.sim.pool import KVPool, OutOfBlocks


def test_allocation_rounds_up_to_whole_blocks_and_free_returns_them():
    pool = KVPool(num_blocks=4, block_size=16)
    blocks = pool.allocate(17)
    assert len(blocks) == 2 and pool.free_blocks == 2
    pool.free(blocks)
    assert pool.free_blocks == 4


def test_exhaustion_raises_without_taking_anything():
    pool = KVPool(num_blocks=2, block_size=4)
    with pytest.raises(OutOfBlocks, match="3 blocks needed, 2 free"):
        pool.allocate(9)
    assert pool.free_blocks == 2


def test_double_free_is_refused():
    pool = KVPool(num_blocks=2, block_size=4)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(blocks)


def test_every_rank_has_one_buffer_per_layout_region():
    pool = KVPool(num_blocks=8, block_size=16, tp_size=2)
    assert [[b.nbytes for b in rank] for rank in pool.buffers] == [[r.nbytes for r in layout.regions] for layout in pool.layouts]


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_token_bytes_do_not_depend_on_tp_size_or_block_placement(tp_size):
    tokens = list(range(40))
    reference = KVPool(num_blocks=8, block_size=16)
    ref_blocks = reference.allocate(40)
    prefill(reference, ref_blocks, tokens)
    pool = KVPool(num_blocks=16, block_size=16, tp_size=tp_size)
    pool.allocate(50)  # other requests' blocks come first
    blocks = pool.allocate(40)
    prefill(pool, blocks, tokens)
    assert pool.token_bytes(blocks, 40) == reference.token_bytes(ref_blocks, 40)
    assert generate(pool.token_bytes(blocks, 40), 4) == generate(reference.token_bytes(ref_blocks, 40), 4)


def test_tp_size_must_divide_the_kv_heads():
    with pytest.raises(ValueError, match="must divide"):
        KVPool(num_blocks=4, block_size=16, tp_size=3)


@pytest.mark.parametrize("args", [(0, 4, 1), (4, 0, 1), (4, 4, 0)])
def test_non_positive_sizes_are_rejected(args):
    with pytest.raises(ValueError, match="must be positive"):
        KVPool(*args)
