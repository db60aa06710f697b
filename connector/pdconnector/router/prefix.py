"""What prompt prefixes an engine holds: vLLM's block hashes recomputed by the router, and a bounded index of
the hashes each engine has cached.

vLLM keys its prefix cache by chained block hashes: block ``i`` of a prompt hashes ``(hash of block i-1, the
block's token ids, extra keys)``, the first block chaining from a hash of a seed, and only full blocks count.
The router recomputes the same hashes from a prompt's token ids, so the hashes vLLM publishes in its KV cache
events (``--kv-events-config``) and the router's own record of what it routed compare directly. Requests with
extra keys (LoRA, multimodal inputs, cache salts, prompt embeddings) hash differently in vLLM; the router
computes none of those, so such a request simply finds no prefix: a missed hit, never a wrong answer.

Hashes are compared as vLLM's 64-bit external form (the low 64 bits of the digest, as
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` publishes them), so events of either form match.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import cbor2

HashAlgorithm = Literal["sha256", "sha256_cbor"]
# vLLM's seed for its first block's parent when PYTHONHASHSEED is unset and the hash is cryptographic.
DEFAULT_HASH_SEED = "vllm-none-hash"
_LOW_64 = (1 << 64) - 1


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


_HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}


def external_hash(value: bytes | int) -> int:
    """A block hash as an event carries it (digest bytes, or vLLM's 64-bit int form) in the index's form."""
    if isinstance(value, int):
        return value & _LOW_64
    return int.from_bytes(value, "big") & _LOW_64


class BlockHasher:
    """vLLM's prefix-cache block hashes for a prompt's token ids, under the engines' block size, hash
    algorithm (``--prefix-caching-hash-algo``) and seed (their ``PYTHONHASHSEED``, or vLLM's default)."""

    def __init__(self, block_size: int, algorithm: HashAlgorithm = "sha256", seed: str | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1 (got {block_size})")
        if algorithm not in _HASH_FUNCTIONS:
            raise ValueError(f"hash algorithm must be one of {sorted(_HASH_FUNCTIONS)} (got {algorithm!r})")
        self.block_size = block_size
        self._hash = _HASH_FUNCTIONS[algorithm]
        self._root = self._hash(DEFAULT_HASH_SEED if seed is None else seed)

    def block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """The hashes of the prompt's full blocks, first block first."""
        hashes = []
        parent = self._root
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = self._hash((parent, tuple(token_ids[start : start + self.block_size]), None))
            hashes.append(external_hash(parent))
        return hashes


class PrefixIndex:
    """The block hashes one engine is believed to hold, least recently used first, at most ``capacity``.

    Fed by the prompts the router sent it and, where the engine publishes them, by its KV events (exact up to
    lost events, and removing what it evicts). Without events it is an approximation: ``capacity`` stands in
    for the engine's real cache size, so the oldest prompts are forgotten about when the engine would have
    evicted them."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 (got {capacity})")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def store(self, hashes: Iterable[int]) -> None:
        for block in hashes:
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def remove(self, hashes: Iterable[int]) -> None:
        for block in hashes:
            self._blocks.pop(block, None)

    def clear(self) -> None:
        self._blocks.clear()

    def matched_blocks(self, hashes: Sequence[int]) -> int:
        """How many of the prompt's leading blocks the engine holds (a hash chains its whole prefix, so the
        first block missing ends the match). Looking does not count as a use: only routing there does."""
        matched = 0
        for block in hashes:
            if block not in self._blocks:
                break
            matched += 1
        return matched
