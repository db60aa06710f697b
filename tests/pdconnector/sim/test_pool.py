"""The KV pool's block allocator and byte layout."""

from __future__ import annotations

import numpy as np
import pytest
from pdconnector.sim.pool import KVPool, OutOfBlocks


def test_allocation_rounds_up_to_whole_blocks_and_free_returns_them():
    pool = KVPool(num_blocks=4, block_size=16, bytes_per_token=8)
    blocks = pool.allocate(17)
    assert len(blocks) == 2 and pool.free_blocks == 2
    pool.free(blocks)
    assert pool.free_blocks == 4


def test_exhaustion_raises_without_taking_anything():
    pool = KVPool(num_blocks=2, block_size=4, bytes_per_token=8)
    with pytest.raises(OutOfBlocks, match="3 blocks needed, 2 free"):
        pool.allocate(9)
    assert pool.free_blocks == 2


def test_double_free_is_refused():
    pool = KVPool(num_blocks=2, block_size=4, bytes_per_token=8)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(blocks)


def test_rows_written_to_scattered_blocks_read_back_in_order():
    pool = KVPool(num_blocks=6, block_size=4, bytes_per_token=3)
    pool.allocate(8)  # occupy the first blocks so the next ones are not 0..n
    blocks = pool.allocate(10)
    rows = np.arange(30, dtype=np.uint8).reshape(10, 3)
    pool.write(blocks, rows)
    assert np.array_equal(pool.read(blocks, 10), rows)


@pytest.mark.parametrize("args", [(0, 4, 4), (4, 0, 4), (4, 4, 0)])
def test_non_positive_sizes_are_rejected(args):
    with pytest.raises(ValueError, match="must be positive"):
        KVPool(*args)
