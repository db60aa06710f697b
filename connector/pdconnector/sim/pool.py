"""A KV pool in host memory: fixed-size blocks in one numpy array, handed out by a free-list allocator."""

from __future__ import annotations

import numpy as np


class OutOfBlocks(Exception):
    pass


class KVPool:
    def __init__(self, num_blocks: int, block_size: int, bytes_per_token: int) -> None:
        if num_blocks < 1 or block_size < 1 or bytes_per_token < 1:
            raise ValueError("num_blocks, block_size and bytes_per_token must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        self.memory = np.zeros((num_blocks, block_size, bytes_per_token), dtype=np.uint8)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._allocated: set[int] = set()

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

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

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if block not in self._allocated:
                raise ValueError(f"block {block} is not allocated")
            self._allocated.remove(block)
            self._free.append(block)

    def write(self, blocks: list[int], kv: np.ndarray) -> None:
        """Store per-token KV rows into the blocks, in order."""
        flat = self.memory[blocks].reshape(-1, self.bytes_per_token)
        flat[: len(kv)] = kv
        self.memory[blocks] = flat.reshape(len(blocks), self.block_size, self.bytes_per_token)

    def read(self, blocks: list[int], num_tokens: int) -> np.ndarray:
        return self.memory[blocks].reshape(-1, self.bytes_per_token)[:num_tokens].copy()
