"""The autoscaling planner: how many engines each role needs to hold the service's targets, from what the
router and the engines measured. Pure: the caller passes the samples and the time; nothing here reads a clock
or a socket.

Per sample, each role's *pressure* is its worst signal over its target: prefill's TTFT percentile and the
prompts waiting per prefill engine, decode's time per output token and the requests running per decode engine.
At that sample the role needs ``ceil(engines * pressure)`` engines; a pressure inside ``1 +- tolerance`` needs
the engines it had, so a load near its target holds still.

Windows damp the decision as Kubernetes' HPA stabilisation does: a role scales up to the smallest need of the
scale-up window (a load that lasted the window, not a spike) and down to the largest need of the scale-down
window, only once that whole window was measured on no more engines than the role has (the load stayed low
that long on them; an engine that missed a scrape does not hold it back). A scale-down keeps half a role's
engines, rounded down (an HPA's 50 % per period policy): a latency well under its target does not say how few
engines would hold it (queueing makes latency grow faster than the load per engine), so the role steps down
and measures again at the new count. Bounds and the prefill:decode ratio range come last: of the replica pairs
inside both, the planner picks the one that leaves the least need uncovered, then the fewest engines, then the
closest to the needs; so a role is never held below what it needs to keep the ratio, unless its maximum forces
it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdconnector.protocol.params import EngineRole

_RATIO_SLACK = 1e-9  # float ratios compared with this much room


@dataclass(frozen=True)
class RoleBounds:
    min_replicas: int
    max_replicas: int

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"minReplicas {self.min_replicas} and maxReplicas {self.max_replicas}: need 0 <= min <= max"
            )


@dataclass(frozen=True)
class Targets:
    """What the service must hold; None: not a target. At least one per role."""

    ttft_s: float | None = None  # prefill: the TTFT percentile the router measured
    waiting_per_prefill: float | None = (
        None  # prefill: prompts waiting per engine (vllm:num_requests_waiting)
    )
    tpot_s: float | None = None  # decode: the time-per-output-token percentile
    running_per_decode: float | None = None  # decode: requests running per engine (vllm:num_requests_running)

    def __post_init__(self) -> None:
        for name in ("ttft_s", "waiting_per_prefill", "tpot_s", "running_per_decode"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"target {name} must be positive, got {value!r}")
        if self.ttft_s is None and self.waiting_per_prefill is None:
            raise ValueError("prefill needs a target: a TTFT percentile or waiting prompts per engine")
        if self.tpot_s is None and self.running_per_decode is None:
            raise ValueError("decode needs a target: a time-per-output-token percentile or running requests")


@dataclass(frozen=True)
class Policy:
    prefill: RoleBounds
    decode: RoleBounds
    targets: Targets
    ratio_min: float  # prefill engines per decode engine, at least
    ratio_max: float  # and at most
    scale_up_window_s: float = 30.0
    scale_down_window_s: float = 300.0
    tolerance: float = 0.1

    def __post_init__(self) -> None:
        if not (0 <= self.ratio_min <= self.ratio_max and self.ratio_max > 0):
            raise ValueError(
                f"ratio range [{self.ratio_min}, {self.ratio_max}]: need 0 <= min <= max, max > 0"
            )
        if not 0 <= self.scale_up_window_s <= self.scale_down_window_s:
            raise ValueError(
                f"windows: scale-up {self.scale_up_window_s} s must be >= 0 and at most scale-down "
                f"{self.scale_down_window_s} s"
            )
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must lie in [0, 1), got {self.tolerance}")
        if not feasible_pairs(self):
            raise ValueError(
                f"no prefill replicas in [{self.prefill.min_replicas}, {self.prefill.max_replicas}] and "
                f"decode replicas in [{self.decode.min_replicas}, {self.decode.max_replicas}] keep the ratio "
                f"in [{self.ratio_min}, {self.ratio_max}]"
            )


@dataclass(frozen=True)
class Sample:
    """The service over one scrape interval ending at ``at`` (seconds, the caller's monotonic clock), with the
    engines each role had serving through it. Latencies are None when no request ended in the interval."""

    at: float
    prefill_replicas: int
    decode_replicas: int
    ttft_s: float | None = None
    tpot_s: float | None = None
    prefill_waiting: float = 0.0  # summed over the prefill engines
    decode_running: float = 0.0  # summed over the decode engines

    def engines(self, role: EngineRole) -> int:
        return self.prefill_replicas if role is EngineRole.PREFILL else self.decode_replicas


@dataclass(frozen=True)
class Replicas:
    prefill: int
    decode: int

    def of(self, role: EngineRole) -> int:
        return self.prefill if role is EngineRole.PREFILL else self.decode


@dataclass(frozen=True)
class Need:
    """What one sample says a role needs, and which signal said it."""

    replicas: int
    signal: str
    pressure: float


@dataclass(frozen=True)
class Decision:
    replicas: Replicas
    reason: str


def need(policy: Policy, sample: Sample, role: EngineRole) -> Need:
    """Engines ``role`` needs at ``sample``, from its worst signal."""
    targets = policy.targets
    engines = sample.engines(role)
    if role is EngineRole.PREFILL:
        signals = [
            ("ttft", sample.ttft_s, targets.ttft_s),
            ("waiting prompts", _per_engine(sample.prefill_waiting, engines), targets.waiting_per_prefill),
        ]
    else:
        signals = [
            ("tpot", sample.tpot_s, targets.tpot_s),
            ("running requests", _per_engine(sample.decode_running, engines), targets.running_per_decode),
        ]
    pressures = [(value / target, name) for name, value, target in signals if value is not None and target]
    if not pressures:
        return Need(engines, "no signal", 1.0)
    pressure, signal = max(pressures)
    if engines == 0:
        # nothing serves: any demand needs one engine to start from
        return Need(1 if pressure > 0 else 0, signal, pressure)
    if abs(pressure - 1) <= policy.tolerance:
        return Need(engines, signal, pressure)
    return Need(max(1, math.ceil(engines * pressure - _RATIO_SLACK)), signal, pressure)


def plan(policy: Policy, history: Sequence[Sample], current: Replicas, now: float) -> Decision:
    """The replicas each role should have at ``now`` given the samples so far (any order) and what the roles
    have; the reason names the signal and window behind each change. Samples older than the scale-down window
    only say that the window is covered: keep the newest such sample, or no role ever scales down."""
    recent = sorted(
        (s for s in history if now - policy.scale_down_window_s <= s.at <= now), key=lambda s: s.at
    )
    if not recent:
        return _fit(policy, current, "no metrics in the scale-down window: holding")
    up_window = [s for s in recent if s.at >= now - policy.scale_up_window_s] or recent[-1:]
    wanted: dict[EngineRole, int] = {}
    reasons: list[str] = []
    for role in EngineRole:
        have = current.of(role)
        up = min((need(policy, s, role) for s in up_window), key=lambda n: n.replicas)
        down = max((_need_to_keep(policy, s, role, have) for s in recent), key=lambda n: n.replicas)
        if up.replicas > have:
            wanted[role] = up.replicas
            reasons.append(
                f"{role} {have} -> {up.replicas}: {up.signal} at {up.pressure:.2f}x its target through "
                f"{policy.scale_up_window_s:g} s"
            )
        elif down.replicas < have and _measured_on_at_most(
            history, role, have, now - policy.scale_down_window_s
        ):
            wanted[role] = max(down.replicas, have // 2)
            halved = " (half at a time)" if wanted[role] > down.replicas else ""
            reasons.append(
                f"{role} {have} -> {wanted[role]}{halved}: {down.signal} at most {down.pressure:.2f}x its "
                f"target through {policy.scale_down_window_s:g} s"
            )
        else:
            wanted[role] = have
    needs = Replicas(wanted[EngineRole.PREFILL], wanted[EngineRole.DECODE])
    return _fit(policy, needs, "; ".join(reasons) or "within targets: holding")


def _need_to_keep(policy: Policy, sample: Sample, role: EngineRole, engines: int) -> Need:
    """What ``sample`` says ``role`` needs, engines that did not answer it counted as needed: scaling down, an
    HPA takes a pod without metrics as at its target, so a dead or pending engine does not make the healthy
    ones look like too many (the highest ordinals, healthy or not, are the ones that leave)."""
    needed = need(policy, sample, role)
    silent = max(0, engines - sample.engines(role))
    return replace(needed, replicas=needed.replicas + silent)


def _measured_on_at_most(history: Sequence[Sample], role: EngineRole, engines: int, since: float) -> bool:
    """Whether every interval from ``since`` on measured ``role`` on at most ``engines`` engines (a sample at
    or before ``since`` says the window is covered): a latency measured on more engines, before a scale-down,
    says little about how fewer do."""
    return any(s.at <= since for s in history) and all(
        s.engines(role) <= engines for s in history if s.at > since
    )


def feasible_pairs(policy: Policy) -> list[Replicas]:
    """Every replica pair inside both roles' bounds whose ratio lies in the range (0 decode engines: only with
    0 prefill engines)."""
    pairs = []
    for decode in range(policy.decode.min_replicas, policy.decode.max_replicas + 1):
        if decode == 0:
            if policy.prefill.min_replicas == 0:
                pairs.append(Replicas(0, 0))
            continue
        low = max(policy.prefill.min_replicas, math.ceil(policy.ratio_min * decode - _RATIO_SLACK))
        high = min(policy.prefill.max_replicas, math.floor(policy.ratio_max * decode + _RATIO_SLACK))
        pairs += [Replicas(prefill, decode) for prefill in range(low, high + 1)]
    return pairs


def _fit(policy: Policy, needs: Replicas, reason: str) -> Decision:
    """The feasible pair closest to ``needs``: least need uncovered, then fewest engines, then nearest."""

    def cost(pair: Replicas) -> tuple[int, int, int]:
        short = max(0, needs.prefill - pair.prefill) + max(0, needs.decode - pair.decode)
        distance = abs(needs.prefill - pair.prefill) + abs(needs.decode - pair.decode)
        return short, pair.prefill + pair.decode, distance

    chosen = min(feasible_pairs(policy), key=cost)
    if chosen != needs:
        reason += (
            f"; bounds and ratio [{policy.ratio_min:g}, {policy.ratio_max:g}] make it prefill "
            f"{chosen.prefill}, decode {chosen.decode}"
        )
    return Decision(chosen, reason)


def _per_engine(total: float, engines: int) -> float:
    """``total`` per engine; with none, all of it (demand for the first one)."""
    return total / max(engines, 1)
