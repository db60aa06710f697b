"""One transfer's timeline on one rank: when it passed each milestone, and the stages between them.

Each side stamps milestones on its own monotonic clock as the transfer passes them; a stage is the
time between two stamps of the same rank, never a difference of two machines' clocks. Together with
the router's legs and vLLM's own steps (the connector's scheduler side adds ``admission`` and
``resume``) the stages say where a request's time to first token goes:

============  ================================================================================
stage         from -> to
============  ================================================================================
handshake     decode asked for the KV -> it knows the prefill engine's agents (cached: ~0)
kv_wait       registration sent (push) or READs posted (pull) -> every byte landed
registration  prefill finished -> decode's registration arrived (0 when decode was first)
post          both halves known -> the WRITE posted (planning the descriptors, posting them)
write         WRITE posted -> completed
hold          prefill finished -> its blocks released (pull: decode's READ done)
admission     the decode leg reached vLLM -> vLLM allocated its blocks (queueing in the scheduler)
resume        the KV arrived -> vLLM scheduled the request's first decode step
============  ================================================================================

The last two are vLLM's scheduler steps around a transfer, timed by the connector's scheduler side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final


class Milestone(StrEnum):
    REQUESTED = "requested"  # decode: the engine asked for the KV
    HANDSHAKEN = "handshaken"  # decode: the prefill engine's agents are loaded
    ASKED = "asked"  # decode: registration sent (push) / READs posted (pull)
    RECEIVED = "received"  # decode: every byte landed
    PREFILLED = "prefilled"  # prefill: finished, blocks held
    REGISTERED = "registered"  # prefill: the (last) registration arrived
    POSTED = "posted"  # prefill: the (last) WRITE posted
    WRITTEN = "written"  # prefill: the last WRITE completed
    RELEASED = "released"  # prefill: blocks handed back


class Stage(StrEnum):
    HANDSHAKE = "handshake"
    KV_WAIT = "kv_wait"
    REGISTRATION = "registration"
    POST = "post"
    WRITE = "write"
    HOLD = "hold"
    ADMISSION = "admission"
    RESUME = "resume"


# Each stage runs from the latest of its start milestones to its end milestone.
STAGES: Final[dict[Stage, tuple[tuple[Milestone, ...], Milestone]]] = {
    Stage.HANDSHAKE: ((Milestone.REQUESTED,), Milestone.HANDSHAKEN),
    Stage.KV_WAIT: ((Milestone.ASKED,), Milestone.RECEIVED),
    Stage.REGISTRATION: ((Milestone.PREFILLED,), Milestone.REGISTERED),
    Stage.POST: ((Milestone.PREFILLED, Milestone.REGISTERED), Milestone.POSTED),
    Stage.WRITE: ((Milestone.POSTED,), Milestone.WRITTEN),
    Stage.HOLD: ((Milestone.PREFILLED,), Milestone.RELEASED),
}

# Milestones a transfer passes once per decode rank it writes (one registration and one WRITE each): the last
# counts, so ``post`` and ``write`` are those of the rank that came last.
_LAST: Final = frozenset({Milestone.REGISTERED, Milestone.POSTED, Milestone.WRITTEN})


@dataclass
class Timeline:
    marks: dict[Milestone, float] = field(default_factory=dict)

    def mark(self, milestone: Milestone, now: float) -> None:
        if milestone in _LAST or milestone not in self.marks:
            self.marks[milestone] = now

    def stages(self) -> dict[str, float]:
        """Seconds spent in each stage whose milestones were all passed (a stage that ended before it began:
        0)."""
        out = {}
        for stage, (starts, end) in STAGES.items():
            if end in self.marks and all(start in self.marks for start in starts):
                out[stage.value] = max(0.0, self.marks[end] - max(self.marks[start] for start in starts))
        return out
