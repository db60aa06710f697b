"""The mock engine's KV pools: one buffer per registered region per TP rank, shaped by the connector core's layout.

The memory is laid out exactly as :class:`pdconnector.layout.RankLayout` says (the same model the real connector plans
transfers with), so the transfer worker moves these bytes with the same descriptors it would use inside vLLM. Blocks
are handed out by a free-list allocator; one block id means the same page in every region of every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdconnector.layout import AttentionSpec, LayerKind, ModelSpec, RankLayout

# The mock model: dense attention, packed HND pages (per KV head: block_size tokens of K and V).
MOCK_LAYERS = 2
MOCK_KV_HEADS = 4
MOCK_HEAD_DIM = 8
MOCK_DTYPE_BYTES = 2


def mock_model(block_size: int) -> ModelSpec:
    attention = AttentionSpec(num_kv_heads=MOCK_KV_HEADS, head_dim=MOCK_HEAD_DIM, dtype_bytes=MOCK_DTYPE_BYTES)
    return ModelSpec((LayerKind.ATTENTION,) * MOCK_LAYERS, block_size=block_size, attention=attention)


class OutOfBlocks(Exception):
    pass


class KVPool:
    def __init__(self, num_blocks: int, block_size: int, tp_size: int = 1) -> None:
        if num_blocks < 1 or block_size < 1 or tp_size < 1:
            raise ValueError("num_blocks, block_size and tp_size must be positive")
        if MOCK_KV_HEADS % tp_size:
            raise ValueError(f"tp_size {tp_size} must divide the mock model's {MOCK_KV_HEADS} KV heads")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tp_size = tp_size
        self.model = mock_model(block_size)
        self.layouts = [RankLayout(self.model, tp_size, rank, num_blocks) for rank in range(tp_size)]
        self.buffers = [[np.zeros(region.nbytes, dtype=np.uint8) for region in layout.regions] for layout in self.layouts]
        self._free = list(range(num_blocks - 1, -1, -1))
        self._allocated: set[int] = set()

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, num_tokens: int) -> list[int]:
        needed = self.blocks_for(num_tokens)
        if needed > len(self._free):
            raise OutOfBlocks(f"{needed} blocks needed, {len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.pop() for _ in range(needed)]
        self._allocated.update(blocks)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if block not in self._allocated:
                raise ValueError(f"block {block} is not allocated")
            self._allocated.remove(block)
            self._free.append(block)

    def token_bytes(self, blocks: Sequence[int], num_tokens: int) -> bytes:
        """K and V of the first ``num_tokens`` tokens held in ``blocks``, in a TP-independent order.

        Order: region, block, global KV head, token. Ranks hold consecutive heads, so concatenating their
        head shards gives the unsharded page whatever the TP size, and a co-located engine with another TP
        size produces the same bytes for the same prompt.
        """
        layout = self.layouts[0]
        heads_per_rank = MOCK_KV_HEADS // self.tp_size
        token_row = 2 * MOCK_HEAD_DIM * MOCK_DTYPE_BYTES
        ids = np.asarray(blocks, dtype=np.int64)
        parts = []
        for region in range(len(layout.regions)):
            shards = []
            for rank in range(self.tp_size):
                pages = self.buffers[rank][region].reshape(self.num_blocks, -1)[ids]
                shards.append(pages[:, : heads_per_rank * self.block_size * token_row].reshape(len(ids), heads_per_rank, self.block_size, token_row))
            whole = np.concatenate(shards, axis=1)  # (blocks, heads, block_size, row)
            tokens = whole.transpose(1, 0, 2, 3).reshape(MOCK_KV_HEADS, -1, token_row)[:, :num_tokens]
            parts.append(tokens.tobytes())
        return b"".join(parts)
