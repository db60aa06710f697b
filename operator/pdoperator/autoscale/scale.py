"""The engines of each role under the autoscaler: how many run and how many take new requests, and how a
decision moves them (pure).

A role scales up at once: the new engines serve as soon as the router's health checks find them ready. It
scales down in two steps, so that no request fails for it: the engines above the new count first leave the
router's pool (``serving`` drops; they stay up and finish what they hold), and the StatefulSet loses them
(``replicas`` drops, highest ordinals first, which are exactly those) only once each is idle: the router
reports it draining with no request and no KV transfer on it, and the engine itself runs and queues none.
A drain that outlasts its timeout ends anyway.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from pdconnector.protocol.params import EngineRole

from .planner import Policy, Replicas, plan


@dataclass(frozen=True)
class RoleScale:
    replicas: int  # engines the StatefulSet runs
    serving: int  # of them, the lowest ordinals take new requests

    def __post_init__(self) -> None:
        if not 0 <= self.serving <= self.replicas:
            raise ValueError(f"serving {self.serving} must lie in [0, replicas {self.replicas}]")

    @property
    def draining(self) -> range:
        """Ordinals out of the router's pool, still running."""
        return range(self.serving, self.replicas)


@dataclass(frozen=True)
class Scale:
    prefill: RoleScale
    decode: RoleScale

    def of(self, role: EngineRole) -> RoleScale:
        return self.prefill if role is EngineRole.PREFILL else self.decode

    @property
    def serving(self) -> Replicas:
        return Replicas(self.prefill.serving, self.decode.serving)

    @property
    def draining(self) -> bool:
        return bool(self.prefill.draining or self.decode.draining)


def steady(replicas: Replicas) -> Scale:
    """Every engine serving."""
    return Scale(RoleScale(replicas.prefill, replicas.prefill), RoleScale(replicas.decode, replicas.decode))


def initial_scale(policy: Policy, requested: Replicas) -> Scale:
    """Where the roles start: the requested counts moved into the bounds and the ratio range."""
    return steady(plan(policy, [], requested, now=0.0).replicas)


def bounded(policy: Policy, stored: Scale) -> Scale:
    """A stored scale under a policy that may have changed since: the serving counts moved into the bounds and
    the ratio range; engines above them drain."""
    serving = plan(policy, [], stored.serving, now=0.0).replicas
    return Scale(
        *(
            RoleScale(max(serving.of(role), stored.of(role).replicas), serving.of(role))
            for role in (EngineRole.PREFILL, EngineRole.DECODE)
        )
    )


def next_scale(
    current: Scale, wanted: Replicas, idle: Mapping[EngineRole, Collection[int]], drain_expired: bool
) -> Scale:
    """The scale after a decision for ``wanted`` serving engines. ``idle`` names, per role, the draining
    ordinals found idle (out of the router's pool with nothing left on them). An engine leaves only if it was
    already draining before this decision (the router has had a round to stop sending to it) and is idle, or
    the drain has outlasted its timeout; the StatefulSet drops the highest ordinals, so the role shrinks to
    just above the highest engine that must stay."""
    roles = []
    for role in (EngineRole.PREFILL, EngineRole.DECODE):
        before = current.of(role)
        serving = wanted.of(role)
        replicas = max(serving, before.replicas)
        while replicas > serving and _may_leave(replicas - 1, before, idle.get(role, ()), drain_expired):
            replicas -= 1
        roles.append(RoleScale(replicas, serving))
    return Scale(*roles)


def _may_leave(ordinal: int, before: RoleScale, idle: Collection[int], drain_expired: bool) -> bool:
    return ordinal in before.draining and (drain_expired or ordinal in idle)
