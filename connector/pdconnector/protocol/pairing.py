"""Which of a prefill rank's finished blocks go into one decode rank's registered blocks.

A registration's ``cached_blocks`` are leading attention blocks decode holds from its prefix cache;
prefill skips as many of its own in every attention group and writes the rest, one for one, into the
registered blocks (SSM groups move their state block as is). Block counts that do not match after the
skip are refused, naming the registration's field, before any WRITE. Pure: block ids in, block ids out.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdconnector.protocol.messages import FailureReason, RegistrationMessage


@dataclass(frozen=True)
class PrefillBlocks:
    """This prefill rank's finished blocks for a transfer (one tuple of block ids per KV group)."""

    transfer_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int


class PairingError(ValueError):
    """A registration whose blocks do not fit prefill's; ``reason`` is what decode is told."""

    def __init__(self, reason: FailureReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def paired_blocks(
    prefill: PrefillBlocks, registration: RegistrationMessage, *, block_size: int, ssm_groups: frozenset[int]
) -> PrefillBlocks:
    """The part of ``prefill`` that goes into ``registration``'s blocks, with the tokens those blocks hold.

    Attention groups skip the ``cached_blocks`` decode already holds; SSM groups (``ssm_groups``,
    already reduced to their state block) move unchanged. ``block_size``: tokens per attention block.
    Raises :class:`PairingError`, naming the registration's field, when the two sides do not fit together.
    """
    rank, skip = registration.decode_tp_rank, registration.cached_blocks
    if len(registration.block_ids) != len(prefill.block_ids):
        detail = (
            f"block_ids: decode rank {rank} registered {len(registration.block_ids)} KV groups, "
            f"prefill has {len(prefill.block_ids)}"
        )
        raise PairingError(FailureReason.INCOMPATIBLE, detail)
    paired: list[tuple[int, ...]] = []
    for group, (ours, theirs) in enumerate(zip(prefill.block_ids, registration.block_ids, strict=True)):
        if group in ssm_groups:
            source, held = ours, f"{len(ours)} state blocks"
        else:
            if skip > len(ours):
                detail = (
                    f"cached_blocks: decode rank {rank} holds {skip} blocks of KV group {group}, "
                    f"prefill has only {len(ours)}"
                )
                raise PairingError(FailureReason.INVALID_REGISTRATION, detail)
            source, held = ours[skip:], f"{len(ours)} blocks of which decode holds the first {skip}"
        if len(source) != len(theirs):
            detail = (
                f"block_ids[{group}]: decode rank {rank} registered {len(theirs)} blocks, prefill has {held}"
            )
            raise PairingError(FailureReason.INVALID_REGISTRATION, detail)
        paired.append(source)
    num_tokens = prefill.num_tokens - skip * block_size
    if num_tokens <= 0 < skip:
        detail = (
            f"cached_blocks: decode rank {rank} holds {skip * block_size} tokens, prefill computed "
            f"only {prefill.num_tokens}"
        )
        raise PairingError(FailureReason.INVALID_REGISTRATION, detail)
    return PrefillBlocks(prefill.transfer_id, tuple(paired), num_tokens)
