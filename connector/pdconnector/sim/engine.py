"""The mock engine's request logic for each role: local, prefill leg, decode leg (push or pull).

Blocks are allocated per request and freed on every path: after a local or decode request, by the mover once a
prefill's blocks were taken or their lease ended, and immediately whenever the request is cancelled (the
client or router closed the connection) or fails.

Nothing here holds the event loop for long: prefill computes its KV a chunk of blocks at a time and generation
one token per step, yielding in between, so health checks are answered and a cancelled request stops while
others run.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from pdconnector.protocol.params import (
    RECEIVED_KEY,
    REMOTE_INCARNATION_KEY,
    TRANSFER_ID_KEY,
    TRANSFER_MODE_KEY,
    EngineRole,
    TransferMode,
    TransferRequest,
)
from pdconnector.sim.metrics import EngineMetrics
from pdconnector.sim.model import generate, kv_digest, prefill_chunks, token_at
from pdconnector.sim.mover import ExportOutcome, KVMover, Receipt, TransferFailed
from pdconnector.sim.pool import KVPool
from pdconnector.sim.scheduler import LatencyModel, Scheduler

# vLLM's --max-model-len of the tiny example (spec.model.maxModelLen): prompt plus output tokens of one
# request.
DEFAULT_MAX_MODEL_LEN = 2048


# vLLM's default --max-num-seqs: requests one engine runs at once.
DEFAULT_MAX_NUM_SEQS = 256

# ``--role`` of a mock engine that serves whole requests itself (``EngineSettings.role`` None).
COLOCATED = "both"


class RoleMismatch(ValueError):
    pass


@dataclass(frozen=True)
class EngineSettings:
    role: EngineRole | None  # None: co-located, no KV transfer
    engine_id: str
    latency: LatencyModel = field(default_factory=LatencyModel)
    transfer_timeout_s: float = 30.0
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    kv_wait_s: float = 0.0  # how long a request waits for KV blocks when the pool is full


@dataclass
class Generation:
    """Output of one request: token ids, produced one by one, plus what the transfer delivered (if any).

    Whoever runs the request closes it exactly once, however the request ended (done, failed, cancelled, even
    before its first token): closing stops the generation and frees the request's blocks.
    """

    prompt_tokens: int
    tokens: AsyncGenerator[int, None]
    receipt: Receipt | None
    transfer_params: dict[str, Any] | None
    release: Callable[[], None]

    async def aclose(self) -> None:
        await self.tokens.aclose()
        self.release()


class MockEngine:
    def __init__(
        self, settings: EngineSettings, pool: KVPool, mover: KVMover | None, metrics: EngineMetrics
    ) -> None:
        if settings.role is not None and mover is None:
            raise ValueError(f"a {settings.role.value} engine needs a KV mover")
        self.settings = settings
        self.pool = pool
        self.mover = mover
        self.metrics = metrics
        self.scheduler = Scheduler(settings.latency, settings.max_num_seqs, settings.kv_wait_s)
        pool.on_free = self.scheduler.blocks_freed
        metrics.requests_waiting.set_function(lambda: self.scheduler.waiting)
        metrics.requests_running.set_function(lambda: self.scheduler.running)

    def _check_role(self, transfer: TransferRequest | None) -> None:
        if transfer is None:
            return
        if self.settings.role is not transfer.role:
            raise RoleMismatch(
                f"this engine runs as {self.settings.role or COLOCATED} and cannot serve a "
                f"{transfer.role.value} leg (kv_transfer_params)"
            )

    async def run(self, prompt: list[int], max_tokens: int, transfer: TransferRequest | None) -> Generation:
        """Start a request; the returned generation yields tokens lazily (close it when done, or to abort)."""
        self._check_role(transfer)
        blocks = await self.scheduler.allocate(self.pool, len(prompt))
        free = functools.partial(self.pool.free, blocks)
        try:
            if transfer is not None and transfer.role is EngineRole.DECODE:
                try:
                    receipt = await self._import(transfer, blocks, len(prompt), free)
                except asyncio.CancelledError:
                    blocks = []  # the mover frees them once nothing can land in them any more
                    raise
                except TransferFailed as error:
                    if error.blocks_kept:
                        blocks = []
                    raise
                return Generation(
                    len(prompt),
                    self._decode(blocks, len(prompt), max_tokens),
                    receipt,
                    _received(receipt),
                    free,
                )
            await self.scheduler.prefill(len(prompt))
            for _ in prefill_chunks(self.pool, blocks, prompt):
                # between chunks: other requests and health checks run, a cancellation lands
                await asyncio.sleep(0)
            if transfer is None:
                return Generation(
                    len(prompt), self._decode(blocks, len(prompt), max_tokens), None, None, free
                )
            first = generate(self.pool.token_bytes(blocks, len(prompt)), 1)
            self.metrics.generation_tokens.inc()
            params = self._export(transfer, blocks, len(prompt))
            blocks = []  # the mover owns them now
            return Generation(len(prompt), _iterate(first), None, params, _nothing_to_free)
        except BaseException:
            if blocks:
                self.pool.free(blocks)
            raise

    async def _import(
        self, transfer: TransferRequest, blocks: list[int], num_tokens: int, free: Callable[[], None]
    ) -> Receipt:
        assert self.mover is not None and transfer.remote is not None
        try:
            if transfer.mode is TransferMode.PUSH:
                receipt = await self.mover.import_pushed(
                    transfer.transfer_id,
                    remote=transfer.remote,
                    block_ids=blocks,
                    num_tokens=num_tokens,
                    deadline_s=self.settings.transfer_timeout_s,
                    free=free,
                )
            else:
                assert transfer.remote_block_ids is not None
                remote_blocks = [block for group in transfer.remote_block_ids for block in group]
                receipt = await self.mover.import_pulled(
                    transfer.transfer_id,
                    remote=transfer.remote,
                    remote_block_ids=remote_blocks,
                    block_ids=blocks,
                    num_tokens=num_tokens,
                    deadline_s=self.settings.transfer_timeout_s,
                    free=free,
                )
        except TransferFailed:
            self.metrics.transfers.labels("import", "failed").inc()
            raise
        self.metrics.transfers.labels("import", "ok").inc()
        self.metrics.transfer_bytes.labels("import").inc(receipt.bytes)
        return receipt

    def _export(self, transfer: TransferRequest, blocks: list[int], num_tokens: int) -> dict[str, Any] | None:
        assert self.mover is not None
        self.metrics.held_blocks.inc(len(blocks))

        def release(outcome: ExportOutcome) -> None:
            self.metrics.held_blocks.dec(len(blocks))
            self.metrics.transfers.labels("export", outcome.value).inc()
            self.pool.free(blocks)

        self.mover.export_blocks(
            transfer.transfer_id, mode=transfer.mode, block_ids=blocks, num_tokens=num_tokens, release=release
        )
        if transfer.mode is TransferMode.PUSH:
            return None
        here = self.mover.side_channel()
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [blocks],
            "remote_engine_id": here.engine_id,
            "remote_host": here.host,
            "remote_port": here.side_channel_port,
            "tp_size": here.tp_size,
            REMOTE_INCARNATION_KEY: here.incarnation,
            "remote_num_tokens": num_tokens,
            TRANSFER_ID_KEY: transfer.transfer_id,
            TRANSFER_MODE_KEY: TransferMode.PULL.value,
        }

    async def _decode(self, blocks: list[int], num_tokens: int, max_tokens: int) -> AsyncGenerator[int, None]:
        loop = asyncio.get_running_loop()
        async with self.scheduler.generating():
            first_at = loop.time()
            for step in range(max_tokens):
                # Every step reads the prompt's KV again, as attention does: a byte landing late in these
                # blocks shows.
                token = token_at(kv_digest(self.pool.token_bytes(blocks, num_tokens)), step)
                await self.scheduler.decode_step()
                self.metrics.generation_tokens.inc()
                if step == 0:
                    first_at = loop.time()
                yield token
            if max_tokens > 1:
                self.metrics.time_per_output_token.observe((loop.time() - first_at) / (max_tokens - 1))


async def _iterate(tokens: list[int]) -> AsyncGenerator[int, None]:
    for token in tokens:
        yield token


def _nothing_to_free() -> None:
    """A prefill leg's blocks belong to the mover once exported: it frees them when they are taken or their
    lease ends."""


def _received(receipt: Receipt) -> dict[str, Any]:
    return {
        RECEIVED_KEY: {"transfer_id": receipt.transfer_id, "bytes": receipt.bytes, "blocks": receipt.blocks}
    }
