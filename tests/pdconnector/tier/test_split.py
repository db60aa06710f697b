"""Decode's split of a request's blocks between its tier and prefill: each block one source, the tier run
pinned, prefill told to skip it."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pdconnector.tier.index import TierIndex
from pdconnector.tier.split import split_prefix

HASHES = ["h0", "h1", "h2", "h3", "h4", "h5"]


def tier_holding(*hashes: str) -> TierIndex:
    index = TierIndex(16)
    index.commit(index.reserve(hashes))
    return index


def test_the_run_the_tier_holds_after_the_prefix_cache_is_loaded_and_prefill_skips_it():
    index = tier_holding("h2", "h3")
    split = split_prefix([20, 21, 22, 23], HASHES, gpu_hits=2, index=index)
    assert (split.tier_blocks, split.remote_blocks, split.cached_blocks) == ((20, 21), (22, 23), 4)
    assert split.tier_hashes == ("h2", "h3") and len(set(split.tier_slots)) == 2


def test_the_run_ends_at_the_first_block_the_tier_lacks_even_if_later_ones_are_held():
    index = tier_holding("h0", "h2")
    split = split_prefix([10, 11, 12], HASHES, gpu_hits=0, index=index)
    assert (split.tier_blocks, split.remote_blocks, split.cached_blocks) == ((10,), (11, 12), 1)


def test_without_tier_hits_everything_after_the_prefix_cache_comes_from_prefill():
    split = split_prefix([30, 31], HASHES, gpu_hits=1, index=tier_holding("h0"))
    assert (split.tier_blocks, split.tier_slots) == ((), ())
    assert (split.remote_blocks, split.cached_blocks) == ((30, 31), 1)


def test_a_partial_last_block_has_no_hash_and_always_comes_from_prefill():
    index = tier_holding(*HASHES)
    split = split_prefix([0, 1, 2, 3, 4, 5, 6], HASHES, gpu_hits=0, index=index)  # 6 full blocks + 1 partial
    assert (split.tier_blocks, split.remote_blocks, split.cached_blocks) == ((0, 1, 2, 3, 4, 5), (6,), 6)


def test_the_run_is_pinned_until_the_load_ends_so_a_save_cannot_evict_it():
    index = TierIndex(2)
    index.commit(index.reserve(["h0", "h1"]))
    split = split_prefix([5, 6], HASHES, gpu_hits=0, index=index)
    assert index.reserve(["other"]) == {}  # both slots are being read
    index.unpin(split.tier_hashes)
    assert list(index.reserve(["other"])) == ["other"]


def test_more_prefix_cache_hits_than_full_blocks_is_refused():
    with pytest.raises(ValueError, match="7 prefix-cache hits for a prompt of 6 full blocks"):
        split_prefix([1], HASHES, gpu_hits=7, index=TierIndex(1))


@given(
    held=st.sets(st.sampled_from(HASHES)),
    gpu_hits=st.integers(0, len(HASHES)),
    extra=st.integers(0, 2),  # partial or not-yet-hashed blocks after the full ones
)
def test_every_block_to_fill_has_exactly_one_source_and_prefill_skips_exactly_the_rest(held, gpu_hits, extra):
    to_fill = list(range(100, 100 + len(HASHES) - gpu_hits + extra))
    split = split_prefix(to_fill, HASHES, gpu_hits, tier_holding(*held))
    assert list(split.tier_blocks + split.remote_blocks) == to_fill
    assert split.cached_blocks == gpu_hits + len(split.tier_blocks)
    assert all(h in held for h in split.tier_hashes)
    assert split.tier_hashes == tuple(HASHES[gpu_hits : split.cached_blocks])
