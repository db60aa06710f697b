"""What the decode side of a transfer worker holds per transfer, in each of its states: looking the prefill
engine up (:class:`Handshaking`), a registered push waiting for its writers (:class:`PushWait`), a pull
reading (:class:`Reading`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from pdconnector.protocol.completion import TransferFailure
from pdconnector.protocol.messages import FailureReason
from pdconnector.protocol.params import PrefillCoordinates
from pdconnector.protocol.timeline import Milestone, Timeline
from pdconnector.transport.base import TransferHandle
from pdconnector.worker.commands import ExpectPush, ReadBlocks
from pdconnector.worker.identity import EngineInfo
from pdconnector.worker.staging import StagedShare


@dataclass
class Handshaking:
    """A decode command waiting for the prefill engine's side-channel info."""

    command: ExpectPush | ReadBlocks
    deadline: float
    info: Future[EngineInfo]
    timeline: Timeline
    # a handshake that failed, or a registration that reached no writer, is tried once more after a fresh
    # lookup: the prefill engine may have restarted under the same coordinates, its agents renamed
    looked_up_again: bool = False


@dataclass
class PushWait:
    """A push registered with its writers, waiting for their completions."""

    attempt: int
    writers: dict[int, str]  # prefill rank -> agent name, for aborts
    prefill: PrefillCoordinates
    timeline: Timeline
    probe: Future[EngineInfo] | None = None  # is the writers' engine still there?
    next_probe: float = 0.0
    staged: dict[int, StagedShare] = field(default_factory=dict)  # by writer: the slot share it was offered


@dataclass
class Reading:
    """A pull whose READs are in flight (or, ``ending``, failed and draining)."""

    command: ReadBlocks
    deadline: float
    handles: dict[int, TransferHandle]  # source prefill rank -> READ in flight
    agents: dict[int, str]
    timeline: Timeline
    nbytes: int = 0
    ending: tuple[FailureReason, str] | None = (
        None  # failed: waiting for the READs left to end or be cancelled
    )


def received_stages(waiting: PushWait | Reading | None, now: float) -> dict[str, float]:
    """The stages of a transfer whose last byte landed at ``now`` (none when nothing waited for it)."""
    if waiting is None:
        return {}
    waiting.timeline.mark(Milestone.RECEIVED, now)
    return waiting.timeline.stages()


def failure_detail(failure: TransferFailure) -> str:
    return f"{failure.side} gave up on attempt {failure.attempt}: {failure.detail}"
