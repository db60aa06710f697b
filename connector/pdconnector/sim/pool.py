"""The mock engine's KV pools: one buffer per registered region per TP rank, shaped by the connector core's
layout.

The memory is laid out exactly as :class:`pdconnector.layout.RankLayout` says (the same model the real
connector plans transfers with), so the transfer worker moves these bytes with the same descriptors it would
use inside vLLM. Blocks are handed out by a free-list allocator; one block id means the same page in every
region of every rank.

The buffers live in host memory (numpy) or in GPU memory (torch CUDA tensors, rank r on ``cuda:{r % device
count}``), as ``--kv-device`` says. Everything above the pool sees pages as host numpy arrays through
:meth:`KVPool.read_pages` and :meth:`KVPool.write_pages`; only the buffers know where the bytes are. torch is
imported for CUDA pools only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pdconnector.layout import AttentionSpec, KVModel, LayerKind, RankLayout

if TYPE_CHECKING:
    import torch

# The mock model: dense attention, packed HND pages (per KV head: block_size tokens of K and V).
MOCK_LAYERS = 2
MOCK_KV_HEADS = 4
MOCK_HEAD_DIM = 8
MOCK_DTYPE_BYTES = 2


def mock_model(block_size: int) -> KVModel:
    attention = AttentionSpec(
        num_kv_heads=MOCK_KV_HEADS, head_dim=MOCK_HEAD_DIM, dtype_bytes=MOCK_DTYPE_BYTES
    )
    return KVModel((LayerKind.ATTENTION,) * MOCK_LAYERS, block_size=block_size, attention=attention)


class OutOfBlocks(Exception):
    pass


class KVDevice(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


class KVDeviceUnavailable(RuntimeError):
    pass


def kv_device_unavailable_reason(device: KVDevice) -> str | None:
    """Why pools cannot be placed on ``device`` in this process, or None when they can."""
    if device is KVDevice.CPU:
        return None
    try:
        import torch  # noqa: PLC0415 (only CUDA pools need torch)
    except ImportError as error:
        return f"CUDA pools need torch: {error}"
    if not torch.cuda.is_available():
        return "no CUDA device is visible to this process (torch.cuda.is_available() is False)"
    return None


class PageBuffer(Protocol):
    """One region of one rank: ``num_blocks`` pages of ``page_bytes``; reads and writes go through host
    arrays."""

    nbytes: int
    address: int  # what the transport registers; stable for the buffer's lifetime
    device_id: int | None  # the CUDA device holding the bytes, None for host memory

    def read(self, blocks: np.ndarray) -> np.ndarray:
        """A host copy of the pages ``blocks``, shape ``(len(blocks), page_bytes)``."""
        ...

    def write(self, blocks: np.ndarray, pages: np.ndarray) -> None:
        """Store ``pages`` (host, ``(len(blocks), page_bytes)``) at ``blocks``; visible to peers when this
        returns."""
        ...


class HostPages:
    def __init__(self, num_blocks: int, page_bytes: int) -> None:
        self.array = np.zeros(num_blocks * page_bytes, dtype=np.uint8)
        self._pages = self.array.reshape(num_blocks, page_bytes)
        self.nbytes = self.array.nbytes
        self.address = self.array.ctypes.data
        self.device_id: int | None = None

    def read(self, blocks: np.ndarray) -> np.ndarray:
        return self._pages[blocks]

    def write(self, blocks: np.ndarray, pages: np.ndarray) -> None:
        self._pages[blocks] = pages


class CudaPages:
    def __init__(self, num_blocks: int, page_bytes: int, device_id: int) -> None:
        import torch  # noqa: PLC0415 (only CUDA pools need torch)

        self._torch = torch
        self.tensor: torch.Tensor = torch.zeros(
            num_blocks * page_bytes, dtype=torch.uint8, device=f"cuda:{device_id}"
        )
        self._pages = self.tensor.view(num_blocks, page_bytes)
        self.nbytes = self.tensor.numel()
        self.address = self.tensor.data_ptr()
        self.device_id = device_id

    def read(self, blocks: np.ndarray) -> np.ndarray:
        index = self._torch.from_numpy(blocks).to(self.tensor.device)
        return self._pages.index_select(0, index).cpu().numpy()

    def write(self, blocks: np.ndarray, pages: np.ndarray) -> None:
        index = self._torch.from_numpy(blocks).to(self.tensor.device)
        self._pages.index_copy_(0, index, self._torch.from_numpy(pages).to(self.tensor.device))
        # NIXL reads these pages outside torch's streams: the copy must have landed before a transfer is
        # announced.
        self._torch.cuda.synchronize(self.tensor.device)


def cuda_device_for(rank: int) -> int:
    """Rank ``rank``'s GPU: one per rank while there are enough, else ranks share them round-robin."""
    import torch  # noqa: PLC0415 (only CUDA pools need torch)

    return rank % torch.cuda.device_count()


class KVPool:
    def __init__(
        self, num_blocks: int, block_size: int, tp_size: int = 1, device: KVDevice = KVDevice.CPU
    ) -> None:
        if num_blocks < 1 or block_size < 1 or tp_size < 1:
            raise ValueError("num_blocks, block_size and tp_size must be positive")
        if MOCK_KV_HEADS % tp_size:
            raise ValueError(f"tp_size {tp_size} must divide the mock model's {MOCK_KV_HEADS} KV heads")
        self.device = KVDevice(device)
        if (reason := kv_device_unavailable_reason(self.device)) is not None:
            raise KVDeviceUnavailable(reason)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tp_size = tp_size
        self.model = mock_model(block_size)
        self.layouts = [RankLayout(self.model, tp_size, rank, num_blocks) for rank in range(tp_size)]
        self.buffers: list[list[PageBuffer]] = [
            [self._buffer(rank, layout.page_bytes) for _ in layout.regions]
            for rank, layout in enumerate(self.layouts)
        ]
        self._free = list(range(num_blocks - 1, -1, -1))
        self._allocated: set[int] = set()
        self.on_free: Callable[[], None] | None = None  # told whenever blocks return

    def _buffer(self, rank: int, page_bytes: int) -> PageBuffer:
        if self.device is KVDevice.CUDA:
            return CudaPages(self.num_blocks, page_bytes, cuda_device_for(rank))
        return HostPages(self.num_blocks, page_bytes)

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
        if self.on_free is not None and blocks:
            self.on_free()

    def read_pages(self, rank: int, region: int, blocks: Sequence[int]) -> np.ndarray:
        """Host copy of ``blocks``' pages in one region of one rank: shape ``(len(blocks), page_bytes)``."""
        return self.buffers[rank][region].read(np.asarray(blocks, dtype=np.int64))

    def write_pages(self, rank: int, region: int, blocks: Sequence[int], pages: np.ndarray) -> None:
        """Store host ``pages`` (``(len(blocks), page_bytes)``) at ``blocks`` in one region of one rank."""
        self.buffers[rank][region].write(
            np.asarray(blocks, dtype=np.int64), np.ascontiguousarray(pages, dtype=np.uint8)
        )

    def token_bytes(self, blocks: Sequence[int], num_tokens: int) -> bytes:
        """K and V of the first ``num_tokens`` tokens held in ``blocks``, in a TP-independent order.

        Order: region, block, global KV head, token. Ranks hold consecutive heads, so concatenating their
        head shards gives the unsharded page whatever the TP size, and a co-located engine with another TP
        size produces the same bytes for the same prompt.
        """
        layout = self.layouts[0]
        heads_per_rank = MOCK_KV_HEADS // self.tp_size
        token_row = 2 * MOCK_HEAD_DIM * MOCK_DTYPE_BYTES
        parts = []
        for region in range(len(layout.regions)):
            shards = []
            for rank in range(self.tp_size):
                pages = self.read_pages(rank, region, blocks)
                shards.append(
                    pages[:, : heads_per_rank * self.block_size * token_row].reshape(
                        len(blocks), heads_per_rank, self.block_size, token_row
                    )
                )
            whole = np.concatenate(shards, axis=1)  # (blocks, heads, block_size, row)
            tokens = whole.transpose(1, 0, 2, 3).reshape(MOCK_KV_HEADS, -1, token_row)[:, :num_tokens]
            parts.append(tokens.tobytes())
        return b"".join(parts)
