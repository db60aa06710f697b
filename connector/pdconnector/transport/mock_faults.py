"""Faults the mock transport can inject, for chaos tests on real engines: late WRITEs, lost or late
notifications.

Set ``PDCONNECTOR_MOCK_FAULTS`` to a JSON object in an engine's environment (only the mock transport reads
it); unknown keys and out-of-range values are refused with the key named. The faults apply on the sending
side, in the order frames leave, so a delayed frame also delays what was queued after it to the same peer (as
a congested link would)."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Final

FAULTS_ENV: Final = "PDCONNECTOR_MOCK_FAULTS"


@dataclass(frozen=True)
class MockFaults:
    write_delay_s: float = 0.0  # a WRITE leaves this much later than it was posted
    delayed_writes: int = -1  # how many WRITEs (the first ones) are delayed; -1: all
    notification_delay_s: float = 0.0  # every standalone notification leaves this much later
    notification_drop_rate: float = 0.0  # the fraction of standalone notifications never sent
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("write_delay_s", "notification_delay_s"):
            if not 0 <= getattr(self, name) <= 3600:
                raise ValueError(
                    f"{FAULTS_ENV}: {name}: expected seconds in [0, 3600], got {getattr(self, name)!r}"
                )
        if self.delayed_writes < -1:
            raise ValueError(
                f"{FAULTS_ENV}: delayed_writes: expected a count or -1 (all), got {self.delayed_writes!r}"
            )
        if not 0 <= self.notification_drop_rate <= 1:
            raise ValueError(
                f"{FAULTS_ENV}: notification_drop_rate: expected a fraction in [0, 1], got "
                f"{self.notification_drop_rate!r}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> MockFaults | None:
        raw = env.get(FAULTS_ENV)
        if not raw:
            return None
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as error:
            raise ValueError(f"{FAULTS_ENV}: not JSON: {error}") from None
        known = {f.name for f in fields(cls)}
        if not isinstance(values, dict) or not set(values) <= known:
            raise ValueError(f"{FAULTS_ENV}: expected an object with keys from {sorted(known)}, got {raw!r}")
        return cls(**values)

    def dropper(self) -> random.Random:
        """The seeded draw that decides which notifications are dropped (one per agent)."""
        return random.Random(self.seed)
