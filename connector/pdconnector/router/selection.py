"""Which backends may take a request, and which one does: per-role policies (least outstanding requests by
default, round-robin, or cache-aware) over the healthy backends that can pair with the request's other
engine."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence
from enum import StrEnum

from pdconnector.protocol.params import EngineRole
from pdconnector.router.backends import Backend, BackendPool
from pdconnector.router.cache_aware import CacheAwareWeights, PromptBlocks, decode_costs, prefill_costs


class Policy(StrEnum):
    LEAST_OUTSTANDING = "least-outstanding"
    ROUND_ROBIN = "round-robin"
    CACHE_AWARE = "cache-aware"


class Selector:
    """Picks one backend of a role among candidates; stateful only for round-robin's cursor."""

    def __init__(self, policy: Policy, role: EngineRole, weights: CacheAwareWeights | None = None) -> None:
        self.policy = policy
        self.role = role
        self.weights = weights or CacheAwareWeights()
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[Backend], prompt: PromptBlocks | None = None) -> Backend | None:
        """``prompt``: the request's blocks, when the cache-aware policy could hash it (without, prefill
        falls back to the least outstanding work)."""
        if not candidates:
            return None
        ordered = sorted(candidates, key=lambda b: b.name)
        if self.policy is Policy.ROUND_ROBIN:
            return ordered[next(self._counter) % len(ordered)]
        if self.policy is Policy.CACHE_AWARE:
            costs = self._costs(ordered, prompt)
            eligible = [b for b in ordered if b.name in costs]
            return min(eligible, key=lambda b: (costs[b.name], b.outstanding, b.served))
        # Ties go to the backend that served fewer requests so far, so equal loads still spread.
        return min(ordered, key=lambda b: (b.outstanding, b.served))

    def _costs(self, ordered: Sequence[Backend], prompt: PromptBlocks | None) -> dict[str, float]:
        if self.role is EngineRole.DECODE:
            return decode_costs(ordered, prompt, self.weights)
        return prefill_costs(ordered, prompt or PromptBlocks(0, 1, ()), self.weights)


class NoBackend(Exception):
    """No backend of ``role`` can take the request; ``reasons`` says why, one line per backend."""

    def __init__(self, role: EngineRole, reasons: list[str]) -> None:
        super().__init__(f"no {role.value} backend: {'; '.join(reasons) or 'none configured'}")
        self.role = role
        self.reasons = reasons


def peer_role(role: EngineRole) -> EngineRole:
    return EngineRole.DECODE if role is EngineRole.PREFILL else EngineRole.PREFILL


def candidates(
    pool: BackendPool, role: EngineRole, refused: Collection[str], partner: Backend | None = None
) -> list[Backend]:
    """Healthy, not draining backends of ``role`` that did not refuse this request (by name) and can pair
    with ``partner``."""
    found = [b for b in pool.serving(role) if b.name not in refused]
    return [b for b in found if partner is None or b.compatible_with(partner)]


def pick_backend(
    pool: BackendPool,
    selectors: Mapping[EngineRole, Selector],
    role: EngineRole,
    refused: Collection[str],
    *,
    partner: Backend | None = None,
    prompt: PromptBlocks | None = None,
) -> Backend:
    """The backend of ``role`` for a request; without a ``partner`` yet, only one that has a compatible
    partner can serve the whole request. Raises :class:`NoBackend` naming why each backend is out."""
    found = candidates(pool, role, refused, partner)
    if partner is None and found:
        found = [b for b in found if candidates(pool, peer_role(role), refused, b)]
        if not found:
            raise NoBackend(peer_role(role), _reasons(pool, peer_role(role), refused, None))
    chosen = selectors[role].pick(found, prompt)
    if chosen is None:
        raise NoBackend(role, _reasons(pool, role, refused, partner))
    return chosen


def _reasons(
    pool: BackendPool, role: EngineRole, refused: Collection[str], partner: Backend | None
) -> list[str]:
    reasons = []
    for backend in sorted(pool.by_role(role), key=lambda b: b.name):
        if not backend.healthy:
            why = f"ejected ({backend.consecutive_failures} failure(s) in a row, last: {backend.last_error})"
        elif backend.spec.draining:
            why = "draining (scaled down: it finishes what it holds, takes nothing new)"
        elif backend.name in refused:
            why = "refused this request's connection"
        elif partner is not None and not backend.compatible_with(partner):
            why = (
                f"engine generation {backend.compat_hash} cannot pair with {partner.name}'s "
                f"{partner.compat_hash}"
            )
        else:
            why = f"no healthy {peer_role(role).value} backend it can pair with"
        reasons.append(f"{backend.name}: {why}")
    return reasons
