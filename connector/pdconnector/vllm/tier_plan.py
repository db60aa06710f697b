"""The KV tier on the scheduler side: which of a decode request's blocks its tier supplies, and which blocks
of a finished request it saves (sans-I/O over vLLM's requests; the copies are the worker side's).

vLLM hashes a request's tokens in blocks of ``hash_block_size`` tokens, each hash chained over the whole
prefix; a block of the attention group (``block_size``, a multiple) is named by the hash of its last hash
block. The index (:class:`~pdconnector.tier.index.TierIndex`) maps those hashes to slots; a hash becomes
readable once every rank copied its block (``finished_sending``).

What the tier holds is published as vLLM's KV cache events (medium ``CPU``, beside the engine's own ``GPU``
events): a block stored once readable, removed when evicted, so a router following the engine's events knows
which prompts it can serve from host memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from pdconnector.tier.index import BlockHash, TierIndex
from pdconnector.tier.split import PrefixSplit, split_prefix
from pdconnector.vllm.metadata import LoadFromTier, SaveToTier
from pdconnector.vllm.stats import TokenSource


@dataclass(frozen=True)
class _Saving:
    chain: tuple[BlockHash, ...]  # the prompt's saved prefix, head first
    written: tuple[BlockHash, ...]  # those the tier lacked: the save writes them
    stored: list[KVCacheEvent]  # their events, published once readable


class TierPlan:
    def __init__(self, slots: int, *, block_size: int, hash_block_size: int) -> None:
        if block_size % hash_block_size:
            raise ValueError(
                f"block size {block_size} is not a multiple of the hash block size {hash_block_size}"
            )
        self.index = TierIndex(slots)
        self.block_size = block_size
        self._hashes_per_block = block_size // hash_block_size
        self._saving: dict[str, _Saving] = {}  # by request id
        self._events: list[KVCacheEvent] = []  # since the last take_events, in order
        self._failed: set[str] = set()  # requests whose save failed on some rank, until their save ended

    def prefill_hit(self, request: Any, num_computed_tokens: int) -> int:
        """Prefill: the tokens after vLLM's prefix-cache hits (``num_computed_tokens``, whole blocks) its tier
        supplies, loaded synchronously before the step computes the rest. At least one prompt token is left to
        compute (it samples the first output token)."""
        gpu_hits = num_computed_tokens // self.block_size
        limit = (int(request.num_tokens) - 1) // self.block_size - gpu_hits
        if limit <= 0:
            return 0
        hashes = self.block_hashes(request)[gpu_hits : gpu_hits + limit]
        return len(self.index.longest_prefix(hashes)) * self.block_size

    def prefill_load(
        self, request: Any, block_ids: Sequence[int], gpu_hits: int, num_external_tokens: int
    ) -> tuple[LoadFromTier | None, dict[TokenSource, int]]:
        """Prefill: the load of the run vLLM allocated for after its ``gpu_hits`` prefix-cache hits
        (``block_ids``: the request's attention blocks), and the request's prompt tokens by source."""
        run = num_external_tokens // self.block_size
        tokens = {
            TokenSource.GPU: gpu_hits * self.block_size,
            TokenSource.TIER: run * self.block_size,
            TokenSource.COMPUTED: int(request.num_tokens) - (gpu_hits + run) * self.block_size,
        }
        if not run:
            return None, tokens
        split = self.split(request, block_ids[gpu_hits : gpu_hits + run], gpu_hits)
        # Nothing evicts between vLLM's two calls (saves reserve slots when requests finish, outside its
        # scheduling pass), so the run it was told of is still readable.
        assert not split.remote_blocks, "the tier lost blocks between lookup and allocation"
        return LoadFromTier(request.request_id, split.tier_slots, split.tier_blocks), tokens

    def split(self, request: Any, to_fill: Sequence[int], gpu_hits: int) -> PrefixSplit:
        """Where ``to_fill`` (the blocks after vLLM's ``gpu_hits`` prefix-cache hits) comes from."""
        split = split_prefix(to_fill, self.block_hashes(request), gpu_hits, self.index)
        # The load runs when a rank takes its command, before any save staged later can reuse these slots
        # (LoadFromTier), so nothing needs them pinned past this step.
        self.index.unpin(split.tier_hashes)
        return split

    def save(self, request: Any, block_ids: Sequence[int], *, after_send: bool = False) -> SaveToTier | None:
        """The save of a finished request's computed full blocks (``block_ids``: its attention blocks) that
        the tier lacks, or None; the request's blocks stay allocated until :meth:`saved`. ``after_send``: the
        copy waits for the end of the request's transfer (prefill)."""
        # The last sampled token has no KV yet: only blocks of computed tokens are saved.
        computed = int(request.num_computed_tokens) // self.block_size
        hashes = self.block_hashes(request)[: min(computed, len(block_ids))]
        reserved = self.index.reserve(hashes)
        self._events += [_removed(block_hash) for block_hash in self.index.take_evicted()]
        if not reserved:
            return None
        positions = [position for position, block_hash in enumerate(hashes) if block_hash in reserved]
        stored = [self._stored(hashes, position, request.all_token_ids) for position in positions]
        written = tuple(hashes[position] for position in positions)
        self._saving[request.request_id] = _Saving(tuple(hashes), written, stored)
        return SaveToTier(
            request.request_id,
            tuple(block_ids[position] for position in positions),
            tuple(reserved[hashes[position]] for position in positions),
            after_send=after_send,
        )

    def save_failed(self, request_id: str) -> None:
        """A rank could not copy the request's blocks: its slots are not to be read."""
        if request_id in self._saving:
            self._failed.add(request_id)

    def saved(self, request_id: str) -> None:
        """Every rank ended the request's save (or it had none here): readable if every rank copied it."""
        saving = self._saving.pop(request_id, None)
        if saving is None:
            return
        if request_id in self._failed:
            self._failed.discard(request_id)
            self.index.abandon(saving.written)
        else:
            self.index.commit(saving.written)
            self.index.touch(saving.chain)  # the prompt's held prefix and its new blocks: one chain
            self._events += saving.stored

    def take_events(self) -> list[KVCacheEvent]:
        """The tier's KV cache events since the last call, in order."""
        events, self._events = self._events, []
        return events

    def _stored(self, hashes: Sequence[BlockHash], position: int, tokens: Sequence[int]) -> BlockStored:
        start = position * self.block_size
        return BlockStored(
            block_hashes=[_external(hashes[position])],
            parent_block_hash=_external(hashes[position - 1]) if position else None,
            token_ids=list(tokens[start : start + self.block_size]),
            block_size=self.block_size,
            lora_id=None,
            medium=MEDIUM_CPU,
            lora_name=None,
        )

    def block_hashes(self, request: Any) -> list[BlockHash]:
        """The request's hashes at the attention group's block size, from its first block."""
        hashes = list(getattr(request, "block_hashes", ()) or ())
        step = self._hashes_per_block
        return hashes[step - 1 :: step]


def _removed(block_hash: BlockHash) -> BlockRemoved:
    return BlockRemoved(block_hashes=[_external(block_hash)], medium=MEDIUM_CPU)


def _external(block_hash: BlockHash) -> Any:
    """A hash as vLLM's events carry it (its digest bytes, or their low 64 bits as an int where vLLM is told
    to), so the tier's blocks match the engine's own events."""
    return maybe_convert_block_hash(block_hash)  # type: ignore[arg-type]
