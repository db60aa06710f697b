"""The KV pools: block allocator, and memory laid out by the connector core's layout on every TP rank."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
from pdconnector.sim.model import generate, prefill
from pdconnector.sim.pool import KVDevice, KVPool, OutOfBlocks
from pdconnector.sim.worker_mover import memory_regions
from pdconnector.transport.base import Device

# sha256 of every pool byte after prefilling range(40) into blocks 0..2 of an 8-block pool, before pools could
# live on GPUs.
HOST_POOL_DIGEST = "38741d715b3a33d00f562f3db0d7ab0c7838ca813c22ada3323ce66e485dc5aa"


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
    assert [[b.nbytes for b in rank] for rank in pool.buffers] == [
        [r.nbytes for r in layout.regions] for layout in pool.layouts
    ]


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


def test_a_host_pool_is_numpy_memory_registered_as_dram_at_its_arrays():
    pool = KVPool(num_blocks=8, block_size=16, tp_size=2)
    assert pool.device is KVDevice.CPU
    for buffers, regions in zip(pool.buffers, memory_regions(pool), strict=True):
        assert [(r.addr, r.nbytes, r.device, r.device_id) for r in regions] == [
            (b.array.ctypes.data, b.array.nbytes, Device.DRAM, 0) for b in buffers
        ]


def test_a_host_pool_holds_the_same_bytes_as_before_pools_could_live_on_gpus():
    pool = KVPool(num_blocks=8, block_size=16)
    prefill(pool, pool.allocate(40), list(range(40)))
    digest = hashlib.sha256()
    for buffer in pool.buffers[0]:
        digest.update(buffer.array.tobytes())
    assert digest.hexdigest() == HOST_POOL_DIGEST


def test_pages_read_back_as_written_and_other_blocks_stay_untouched():
    pool = KVPool(num_blocks=8, block_size=16)
    pages = np.random.default_rng(0).integers(0, 256, (2, pool.layouts[0].page_bytes), dtype=np.uint8)
    pool.write_pages(0, 1, [5, 2], pages)
    assert (pool.read_pages(0, 1, [5, 2]) == pages).all()
    assert not pool.read_pages(0, 1, [0, 1, 3, 4, 6, 7]).any() and not pool.read_pages(0, 0, range(8)).any()


def test_a_host_pool_never_imports_torch():
    code = (
        "import sys; from pdconnector.sim.model import reference_tokens; import pdconnector.sim.main, "
        "pdconnector.sim.worker_mover; "
        "reference_tokens(list(range(20)), 4); assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
