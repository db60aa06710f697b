"""How long decode fences a transfer whose prefill went silent: derived from the liveness probe that kills a
frozen engine.

A prefill rank that answers nothing after decode gave up may be frozen (SIGSTOP, a hung driver call) rather
than gone, and a frozen process can resume and post a WRITE. What bounds it:

* its transfer thread stamps a heartbeat file every turn of its loop, and stops when a WRITE it cannot cancel
  is past its deadline; the engine's liveness probe fails on a stale heartbeat, and the kubelet kills the
  container (and with it its NIC context) within :meth:`LivenessProbe.kill_bound_s` of the last stamp;
* it posts a WRITE only within the registration's lifetime, counted from when its thread took the
  registration, and decode's deadline is the end of that lifetime counted from sending, so a live prefill
  posts no later than decode's deadline plus the time its thread may stall unkilled (one kill bound);
* a posted WRITE ends, is cancelled, or stops the heartbeat, within ``write_timeout_s``; then one more kill
  bound.

A registration's lifetime is decode's time left plus :data:`REGISTRATION_GRACE_S`, so that decode's own abort
(sent at its deadline), not the lifetime, normally ends the transfer on prefill. So nothing of prefill touches
decode's blocks later than ``deadline + grace + write_timeout_s + 2 * kill_bound_s``: decode's fence
(:func:`fence_seconds`), counted from the later of its deadline and its own failure, adds a slack for the
network. The operator renders the probe and this fence together (``pdoperator.render.engine``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

FENCE_SLACK_S: Final = 5.0  # notification transit and clock-rate drift between the two machines
REGISTRATION_GRACE_S: Final = (
    1.0  # a registration outlives decode's deadline by this: decode's abort arrives first
)


@dataclass(frozen=True)
class LivenessProbe:
    """The heartbeat check an engine container runs (an exec liveness probe) and the kubelet's timing of
    it."""

    heartbeat_max_age_s: int = 10
    period_s: int = 5
    timeout_s: int = 5
    failure_threshold: int = 2
    termination_grace_s: int = (
        5  # the probe's own grace: SIGTERM cannot stop a frozen process, SIGKILL follows
    )

    def __post_init__(self) -> None:
        for name in (
            "heartbeat_max_age_s",
            "period_s",
            "timeout_s",
            "failure_threshold",
            "termination_grace_s",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"liveness probe {name} must be at least 1, got {getattr(self, name)}")

    def kill_bound_s(self) -> float:
        """The longest a frozen engine lives after its last heartbeat: stale, then every failing probe, then
        the grace."""
        return float(
            self.heartbeat_max_age_s
            + self.period_s * self.failure_threshold
            + self.timeout_s
            + self.termination_grace_s
        )


def fence_seconds(write_timeout_s: float, probe: LivenessProbe) -> float:
    """How long after its deadline (or its own failure, if later) decode keeps a silent writer's blocks."""
    if write_timeout_s <= 0:
        raise ValueError(f"write_timeout_s must be positive, got {write_timeout_s}")
    return REGISTRATION_GRACE_S + write_timeout_s + 2 * probe.kill_bound_s() + FENCE_SLACK_S
