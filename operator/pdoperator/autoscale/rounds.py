"""One round of the builtin autoscaler (pure): what the router and the engines answered, the samples so far
and the roles' scale in; the next scale, why, and the samples to keep out.

A round whose metrics are missing (the router did not answer, or no serving engine of a role did) adds no
sample: silence is not an idle service, and scaling down on it would take engines from a loaded one. Engines
that are draining add no load to the sample, only their idleness to the drain.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pdconnector.protocol.params import EngineRole

from .planner import Decision, Policy, Sample, plan
from .scale import Scale, next_scale
from .signals import EngineReading, Scrape, engine_reading, is_idle, router_backends, sample, scrape

PodName = Callable[[EngineRole, int], str]


@dataclass(frozen=True)
class Readings:
    """One round of scrapes at ``at`` (the caller's monotonic seconds): ``/metrics`` texts, None where a
    target did not answer."""

    at: float
    router: str | None
    engines: Mapping[str, str | None]  # by pod name


@dataclass(frozen=True)
class History:
    last: Scrape | None = None
    samples: tuple[Sample, ...] = ()

    def add(self, latest: Scrape, percentile: int, keep_s: float) -> History:
        """With the interval ending at ``latest``; samples older than ``keep_s`` dropped but the newest of
        them, which tells the planner its scale-down window is covered."""
        samples = (*self.samples, sample(self.last, latest, percentile))
        old = [s for s in samples if s.at < latest.at - keep_s]
        kept = tuple(s for s in samples if s.at >= latest.at - keep_s)
        return History(latest, (old[-1], *kept) if old else kept)


@dataclass(frozen=True)
class Round:
    scale: Scale
    reason: str
    history: History


def autoscale_round(
    policy: Policy,
    percentile: int,
    history: History,
    current: Scale,
    readings: Readings,
    *,
    pod_name: PodName,
    drain_expired: bool,
    routers_reloaded: bool,
) -> Round:
    """``routers_reloaded``: every router has had time to load the config that marks the draining engines (the
    one router whose metrics are read says so itself; of several, only the others' config reload bounds it).
    Until then no engine counts as idle, as a router still unaware could send it a new request."""
    serving = {
        role: {
            pod: text
            for ordinal in range(current.of(role).serving)
            if (text := readings.engines.get(pod := pod_name(role, ordinal))) is not None
        }
        for role in EngineRole
    }
    silent = [role.value for role in EngineRole if current.of(role).serving and not serving[role]]
    if readings.router is None or silent:
        missing = "the router" if readings.router is None else f"every serving {' and '.join(silent)} engine"
        decision = Decision(current.serving, f"no metrics from {missing}: holding")
    else:
        latest = scrape(readings.at, readings.router, serving[EngineRole.PREFILL], serving[EngineRole.DECODE])
        history = history.add(latest, percentile, policy.scale_down_window_s)
        decision = plan(policy, history.samples, current.serving, readings.at)
    backends = router_backends(readings.router or "")
    idle = {
        role: {
            ordinal
            for ordinal in current.of(role).draining
            if routers_reloaded
            and is_idle(backends.get(pod := pod_name(role, ordinal)), _reading(readings.engines.get(pod)))
        }
        for role in EngineRole
    }
    scale = next_scale(current, decision.replicas, idle, drain_expired)
    return Round(scale, _reason(decision.reason, current, scale, drain_expired), history)


def _reading(text: str | None) -> EngineReading | None:
    return None if text is None else engine_reading(text)


def _reason(decided: str, before: Scale, after: Scale, drain_expired: bool) -> str:
    notes = []
    for role in EngineRole:
        was, now = before.of(role), after.of(role)
        if now.draining:
            notes.append(f"{role} {len(now.draining)} draining")
        elif was.draining and now.replicas < was.replicas:
            how = "drain timed out" if drain_expired else "drained"
            notes.append(f"{role} {was.replicas} -> {now.replicas} {how}")
    return "; ".join([decided, *notes])
