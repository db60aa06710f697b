"""Block hashes as vLLM computes them, and the bounded per-engine index of held blocks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pdconnector.router.prefix import BlockHasher, PrefixIndex, external_hash

# vLLM's own hashing is the reference these tests compare with.
pytest.importorskip("vllm", reason="vLLM is the optional 'engine' extra")
from vllm.utils import hashing
from vllm.v1.core import kv_cache_utils


def vllm_block_hashes(tokens: list[int], block_size: int, algorithm: str) -> list[int]:
    """What vLLM's own code gives for a plain prompt (no LoRA, multimodal input or salt)."""
    hash_fn = hashing.get_hash_fn_by_name(algorithm)
    kv_cache_utils.init_none_hash(hash_fn)
    parent = None
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, tokens[start : start + block_size], None)
        hashes.append(external_hash(kv_cache_utils.maybe_convert_block_hash(parent)))
    return hashes


@given(
    tokens=st.lists(st.integers(min_value=0, max_value=200_000), max_size=90),
    block_size=st.sampled_from([1, 4, 16]),
    algorithm=st.sampled_from(["sha256", "sha256_cbor"]),
)
def test_block_hashes_equal_vllms_for_any_prompt(tokens, block_size, algorithm):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("PYTHONHASHSEED", raising=False)
        expected = vllm_block_hashes(tokens, block_size, algorithm)
    assert BlockHasher(block_size, algorithm).block_hashes(tokens) == expected


def test_only_full_blocks_are_hashed_and_each_chains_its_prefix():
    hasher = BlockHasher(4)
    assert hasher.block_hashes([1, 2, 3]) == []
    first, second = hasher.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert hasher.block_hashes([1, 2, 3, 4]) == [first]
    # the same tokens after another first block hash differently
    assert hasher.block_hashes([9, 9, 9, 9, 5, 6, 7, 8])[1] != second


def test_a_seed_changes_every_hash_as_pythonhashseed_does_in_vllm(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    expected = vllm_block_hashes(list(range(32)), 16, "sha256")
    assert BlockHasher(16, seed="1234").block_hashes(list(range(32))) == expected
    assert BlockHasher(16).block_hashes(list(range(32))) != expected


def test_both_published_forms_of_a_hash_are_the_same_key():
    digest = bytes(range(32))
    assert external_hash(digest) == external_hash(int.from_bytes(digest, "big") & ((1 << 64) - 1))


@pytest.mark.parametrize(("block_size", "algorithm"), [(0, "sha256"), (16, "xxhash")])
def test_a_hasher_vllm_could_not_match_is_refused(block_size, algorithm):
    with pytest.raises(ValueError, match=r"block_size|hash algorithm"):
        BlockHasher(block_size, algorithm)  # type: ignore[arg-type]


def test_the_match_is_the_run_of_leading_blocks_held():
    index = PrefixIndex(capacity=10)
    index.store([1, 2, 3])
    assert index.matched_blocks([1, 2, 3, 4]) == 3
    assert index.matched_blocks([1, 9, 3]) == 1
    assert index.matched_blocks([2, 3]) == 2 and index.matched_blocks([7]) == 0
    index.remove([2])
    assert index.matched_blocks([1, 2, 3]) == 1


def test_the_index_forgets_its_least_recently_stored_blocks_beyond_capacity():
    index = PrefixIndex(capacity=3)
    index.store([1, 2, 3])
    index.store([1])  # used again: now the most recent
    index.store([4])
    assert len(index) == 3
    assert index.matched_blocks([1]) == 1 and index.matched_blocks([2]) == 0
    index.clear()
    assert len(index) == 0
