"""The roles' scale under the autoscaler: up at once, down only through a drain."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from pdconnector.protocol.params import EngineRole
from pdoperator.autoscale.planner import Replicas
from pdoperator.autoscale.scale import RoleScale, Scale, next_scale, steady

NOBODY_IDLE: dict[EngineRole, set[int]] = {}


def test_scaling_up_serves_the_new_engines_at_once():
    after = next_scale(steady(Replicas(1, 2)), Replicas(3, 2), NOBODY_IDLE, drain_expired=False)
    assert after == steady(Replicas(3, 2))


def test_scaling_down_first_drains_the_highest_ordinals_then_removes_them_once_idle():
    draining = next_scale(steady(Replicas(1, 4)), Replicas(1, 2), NOBODY_IDLE, drain_expired=False)
    assert draining.decode == RoleScale(replicas=4, serving=2)
    assert list(draining.decode.draining) == [2, 3]
    half = next_scale(draining, Replicas(1, 2), {EngineRole.DECODE: {2}}, drain_expired=False)
    assert half == draining, "one engine still busy keeps the StatefulSet whole"
    done = next_scale(draining, Replicas(1, 2), {EngineRole.DECODE: {2, 3}}, drain_expired=False)
    assert done == steady(Replicas(1, 2))


def test_a_drain_past_its_timeout_ends_anyway():
    draining = Scale(RoleScale(1, 1), RoleScale(4, 2))
    assert next_scale(draining, Replicas(1, 2), NOBODY_IDLE, drain_expired=True) == steady(Replicas(1, 2))


def test_scaling_back_up_during_a_drain_returns_draining_engines_to_the_pool():
    draining = Scale(RoleScale(1, 1), RoleScale(4, 1))
    assert next_scale(draining, Replicas(1, 3), NOBODY_IDLE, drain_expired=False).decode == RoleScale(4, 3)


@given(
    st.integers(0, 8),
    st.integers(0, 8),
    st.integers(0, 8),
    st.sets(st.integers(0, 8)),
    st.booleans(),
)
def test_the_router_never_loses_an_engine_it_still_sends_to(replicas, serving, wanted, idle, expired):
    serving = min(serving, replicas)
    before = Scale(RoleScale(1, 1), RoleScale(replicas, serving))
    after = next_scale(before, Replicas(1, wanted), {EngineRole.DECODE: idle}, drain_expired=expired)
    assert after.decode.serving == wanted
    assert after.decode.replicas >= wanted
    removed = range(after.decode.replicas, before.decode.replicas)
    # an engine leaves only after a round in which it was already out of the pool (idle or timed out)
    assert all(ordinal >= serving and (expired or ordinal in idle) for ordinal in removed)
