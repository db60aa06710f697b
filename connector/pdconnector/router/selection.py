"""Per-role selection policies: least outstanding requests (default) and round-robin."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from enum import StrEnum

from pdconnector.router.backends import Backend


class Policy(StrEnum):
    LEAST_OUTSTANDING = "least-outstanding"
    ROUND_ROBIN = "round-robin"


class Selector:
    """Picks one backend among candidates; stateful only for round-robin's cursor."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[Backend]) -> Backend | None:
        if not candidates:
            return None
        ordered = sorted(candidates, key=lambda b: b.name)
        if self.policy is Policy.ROUND_ROBIN:
            return ordered[next(self._counter) % len(ordered)]
        # Ties go to the backend that served fewer requests so far, so equal loads still spread.
        return min(ordered, key=lambda b: (b.outstanding, b.served))
