"""What a decode request asks of prefill, from the blocks vLLM allocated for it: pure functions over the
request's block groups and its transfer parameters (the scheduler side's I/O-free core for decode)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from pdconnector.protocol.params import REMOTE_HOLD_KEY, TransferMode, TransferParamsError, TransferRequest
from pdconnector.worker.commands import BlockIds, ExpectPush, ReadBlocks

PULL_HOLD_SLACK_S = 2.0  # router transit and the step between staging a READ and the worker taking it


class Block(Protocol):
    block_id: int
    block_hash: Any
    is_null: bool


def local_blocks(
    block_groups: Sequence[Sequence[Block]], *, num_groups: int, ssm_groups: frozenset[int]
) -> tuple[BlockIds, int]:
    """Decode's blocks to fill (per group) and how many leading attention blocks it already holds (prefix
    hit)."""
    if len(block_groups) != num_groups:
        raise ValueError(f"expected blocks for {num_groups} KV cache groups, got {len(block_groups)}")
    local: list[tuple[int, ...]] = []
    cached = 0
    for g, group in enumerate(block_groups):
        real = [b for b in group if not b.is_null]
        if g in ssm_groups:
            local.append((real[-1].block_id,) if real else ())
            continue
        hits = sum(1 for b in real if b.block_hash is not None)
        cached = max(cached, hits)
        local.append(tuple(b.block_id for b in real if b.block_hash is None))
    return tuple(local), cached


def waited_s(request: Any) -> float:
    """Seconds since the request reached this engine (vLLM stamps ``arrival_time`` with the wall clock)."""
    arrival = getattr(request, "arrival_time", None)
    return max(0.0, time.time() - arrival) if isinstance(arrival, int | float) else 0.0


def decode_command(
    request_id: str,
    transfer: TransferRequest,
    local: BlockIds,
    cached: int,
    num_tokens: int,
    *,
    ssm_groups: frozenset[int],
    lease_s: float,
    waited_s: float,
) -> ExpectPush | ReadBlocks:
    """The registration (push) or READ (pull) that fills ``local`` after ``cached`` prefix-cache hits.
    ``lease_s``: prefill's hold where its answer did not say; ``waited_s``: how long the request has been here
    (a pull READ must end within what is left of prefill's hold)."""
    assert transfer.remote is not None
    if transfer.mode is TransferMode.PUSH:
        # Prefill pairs its blocks with ours after skipping the ``cached`` ones (the registration carries the
        # count).
        return ExpectPush(request_id, transfer.transfer_id, transfer.remote, local, num_tokens, cached)
    remote = transfer.remote_block_ids or ()
    if len(remote) != len(local):
        raise TransferParamsError(
            "remote_block_ids", f"expected {len(local)} KV cache groups, got {len(remote)}"
        )
    matched: list[tuple[int, ...]] = []
    for g, (theirs, ours) in enumerate(zip(remote, local, strict=True)):
        source = theirs[-1:] if g in ssm_groups else theirs[cached : cached + len(ours)]
        if len(source) != len(ours):
            raise TransferParamsError(
                "remote_block_ids",
                f"KV cache group {g}: prefill sent {len(theirs)} blocks, decode needs {len(ours)} after "
                f"{cached} cached",
            )
        matched.append(tuple(source))
    # Prefill's hold began before it answered, so before this request arrived: what is left of it bounds the
    # READs.
    hold_s = transfer.remote_hold_s if transfer.remote_hold_s is not None else lease_s
    valid_for_s = hold_s - waited_s - PULL_HOLD_SLACK_S
    if valid_for_s <= 0:
        detail = (
            f"waited {waited_s:.1f}s at decode; prefill holds its blocks for {hold_s:.1f}s after answering, "
            "so they may be gone"
        )
        raise TransferParamsError(REMOTE_HOLD_KEY, detail)
    return ReadBlocks(
        request_id, transfer.transfer_id, transfer.remote, tuple(matched), local, num_tokens, valid_for_s
    )
