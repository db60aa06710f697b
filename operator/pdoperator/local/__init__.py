"""Local runs: a PDService as processes on this machine, wired exactly as the operator wires pods."""

from .plan import LocalPlan, LocalProcess, LocalRunError, plan_local_run
from .runner import RunningProcess, default_state_dir, down, read_state, up
from .variant import local_variant

__all__ = [
    "LocalPlan",
    "LocalProcess",
    "LocalRunError",
    "RunningProcess",
    "default_state_dir",
    "down",
    "local_variant",
    "plan_local_run",
    "read_state",
    "up",
]
