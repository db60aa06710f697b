"""The autoscaling planner as a specification: never outside the bounds or the ratio range, still on a steady
load, up within one window of a step, down only after its window and by half at a time, and a closed loop over
a capacity model that settles instead of flapping."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, reject, settings
from hypothesis import strategies as st
from pdconnector.protocol.params import EngineRole
from pdoperator.autoscale.planner import (
    Decision,
    Policy,
    Replicas,
    RoleBounds,
    Sample,
    Targets,
    feasible_pairs,
    need,
    plan,
)

UP_S, DOWN_S, INTERVAL_S = 30.0, 120.0, 5.0
TARGETS = Targets(ttft_s=0.5, tpot_s=0.05)


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    def bounds() -> RoleBounds:
        low = draw(st.integers(0, 4))
        return RoleBounds(low, draw(st.integers(max(1, low), 12)))

    ratio_min = draw(st.sampled_from([0.25, 0.5, 1.0]))
    ratio_max = ratio_min * draw(st.sampled_from([1.0, 2.0, 4.0]))
    prefill, decode = bounds(), bounds()
    try:
        return Policy(prefill, decode, TARGETS, ratio_min, ratio_max, UP_S, DOWN_S)
    except ValueError:  # no pair fits: the policy is refused, drawn again
        reject()


def samples(draw: st.DrawFn, now: float, count: int) -> list[Sample]:
    out = []
    for i in range(count):
        out.append(
            Sample(
                at=now - i * INTERVAL_S,
                prefill_replicas=draw(st.integers(0, 12)),
                decode_replicas=draw(st.integers(0, 12)),
                ttft_s=draw(st.none() | st.floats(0.0, 5.0)),
                tpot_s=draw(st.none() | st.floats(0.0, 0.5)),
                prefill_waiting=draw(st.floats(0.0, 50.0)),
                decode_running=draw(st.floats(0.0, 200.0)),
            )
        )
    return out


def in_policy(policy: Policy, replicas: Replicas) -> bool:
    return replicas in feasible_pairs(policy)


@settings(max_examples=300, deadline=None)
@given(policies(), st.data())
def test_a_decision_is_always_inside_the_bounds_and_the_ratio_range(
    policy: Policy, data: st.DataObject
) -> None:
    now = 1000.0
    history = samples(data.draw, now, data.draw(st.integers(0, 40)))
    current = Replicas(data.draw(st.integers(0, 12)), data.draw(st.integers(0, 12)))
    decision = plan(policy, history, current, now)
    assert in_policy(policy, decision.replicas), decision
    assert decision.reason


def steady(
    replicas: Replicas, until: float, *, ttft_s: float, tpot_s: float, since: float = 0.0
) -> list[Sample]:
    count = int((until - since) / INTERVAL_S) + 1
    return [
        Sample(until - i * INTERVAL_S, replicas.prefill, replicas.decode, ttft_s=ttft_s, tpot_s=tpot_s)
        for i in range(count)
    ]


POLICY = Policy(
    RoleBounds(1, 8),
    RoleBounds(1, 8),
    TARGETS,
    ratio_min=0.25,
    ratio_max=2.0,
    scale_up_window_s=UP_S,
    scale_down_window_s=DOWN_S,
)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8), st.floats(0.91, 1.09), st.floats(0.91, 1.09))
def test_a_load_near_its_targets_holds_the_replicas_still(
    prefill: int, decode: int, ttft: float, tpot: float
) -> None:
    current = Replicas(prefill, decode)
    if not in_policy(POLICY, current):
        return
    history = steady(current, 1000.0, ttft_s=ttft * TARGETS.ttft_s, tpot_s=tpot * TARGETS.tpot_s, since=600.0)
    assert plan(POLICY, history, current, 1000.0) == Decision(current, "within targets: holding")


def test_a_step_up_scales_up_once_it_lasted_the_scale_up_window_and_not_before() -> None:
    current = Replicas(2, 2)
    calm = steady(current, 500.0, ttft_s=0.5, tpot_s=0.05, since=300.0)
    step = [s for s in steady(current, 600.0, ttft_s=1.5, tpot_s=0.05, since=505.0)]
    history = calm + step
    # 20 s into the step the scale-up window still holds calm samples: no change yet
    assert plan(POLICY, [s for s in history if s.at <= 520.0], current, 520.0).replicas == current
    decision = plan(POLICY, [s for s in history if s.at <= 540.0], current, 540.0)
    # TTFT 3x its target on 2 engines needs 6; at most 2 prefill engines per decode engine raise decode to 3
    assert decision.replicas == Replicas(6, 3)
    assert "prefill 2 -> 6: ttft at 3.00x its target through 30 s" in decision.reason
    assert "make it prefill 6, decode 3" in decision.reason


def test_a_drop_scales_down_only_after_the_scale_down_window_and_by_half_a_role_per_window() -> None:
    current = Replicas(6, 4)
    busy = steady(current, 500.0, ttft_s=0.5, tpot_s=0.05, since=300.0)
    quiet = steady(current, 630.0, ttft_s=0.1, tpot_s=0.01, since=505.0)  # a fifth of both targets
    history = busy + quiet
    for now in (520.0, 560.0, 600.0, 620.0):  # the busy samples are still inside the 120 s window
        assert plan(POLICY, [s for s in history if s.at <= now], current, now).replicas == current, now
    decision = plan(POLICY, history, current, 630.0)
    # the quiet load needs ceil(6 / 5) and ceil(4 / 5) engines; a scale-down keeps half of each role
    assert decision.replicas == Replicas(3, 2)
    assert "prefill 6 -> 3 (half at a time): ttft at most 0.20x its target through 120 s" in decision.reason
    # the next step down waits for a whole window measured at the new count, though the need said less
    halved = decision.replicas
    history += steady(
        halved, 900.0, ttft_s=0.2, tpot_s=0.02, since=635.0
    )  # the same load on half the engines
    for now in (640.0, 700.0, 745.0):
        assert plan(POLICY, [s for s in history if s.at <= now], halved, now).replicas == halved, now
    # on half the engines the load needs ceil(3 x 0.4) and ceil(2 x 0.4): what the first window said it would
    assert plan(POLICY, [s for s in history if s.at <= 750.0], halved, 750.0).replicas == Replicas(2, 1)


def test_an_engine_that_missed_a_scrape_does_not_hold_a_scale_down_back() -> None:
    current = Replicas(6, 4)
    quiet = steady(current, 630.0, ttft_s=0.1, tpot_s=0.01, since=500.0)
    # one prefill engine did not answer at 600 s: that sample measured five
    history = [dataclasses.replace(s, prefill_replicas=5) if s.at == 600.0 else s for s in quiet]
    assert plan(POLICY, history, current, 630.0).replicas == Replicas(3, 2)


def test_an_engine_that_never_answers_counts_as_needed_so_the_healthy_ones_hold_at_their_target() -> None:
    current = Replicas(6, 4)
    # one prefill engine is dead (or pending): five answer, their TTFT at its target
    history = [
        dataclasses.replace(s, prefill_replicas=5)
        for s in steady(current, 630.0, ttft_s=0.5, tpot_s=0.05, since=500.0)
    ]
    assert plan(POLICY, history, current, 630.0).replicas == current
    quiet = [dataclasses.replace(s, ttft_s=0.1) for s in history]  # a fifth of the target: one engine's need
    assert plan(POLICY, quiet, current, 630.0).replicas.prefill == 3  # half at a time, the silent one counted


def test_the_ratio_range_raises_the_role_that_falls_short_instead_of_starving_the_other() -> None:
    policy = dataclasses.replace(POLICY, ratio_min=0.5, ratio_max=1.0, scale_up_window_s=0.0)
    current = Replicas(2, 2)
    # decode needs 6 (TPOT 3x), prefill is fine: prefill rises to 3 to keep at least 0.5 prefill per decode
    history = steady(current, 500.0, ttft_s=0.5, tpot_s=0.15, since=300.0)
    decision = plan(policy, history, current, 500.0)
    assert decision.replicas == Replicas(3, 6)
    assert "ratio [0.5, 1]" in decision.reason
    # at decode's maximum the ratio caps nothing a role needs
    history = steady(current, 500.0, ttft_s=0.5, tpot_s=0.5, since=300.0)
    assert plan(policy, history, current, 500.0).replicas == Replicas(4, 8)


def test_utilisation_targets_count_per_engine_and_the_worst_signal_decides() -> None:
    targets = Targets(ttft_s=1.0, waiting_per_prefill=2.0, running_per_decode=16.0)
    policy = Policy(RoleBounds(1, 16), RoleBounds(1, 16), targets, 0.1, 10.0, 0.0, DOWN_S)
    sample = Sample(0.0, 4, 2, ttft_s=0.5, prefill_waiting=24.0, decode_running=40.0)
    assert need(policy, sample, EngineRole.PREFILL).replicas == 12  # 6 waiting per engine: 3x
    assert need(policy, sample, EngineRole.PREFILL).signal == "waiting prompts"
    assert need(policy, sample, EngineRole.DECODE).replicas == 3  # 20 running per engine: 1.25x of 2 engines
    idle = Sample(0.0, 0, 0, ttft_s=None, prefill_waiting=3.0)
    assert need(policy, idle, EngineRole.PREFILL).replicas == 1  # demand with nothing serving starts one


def closed_loop(
    policy: Policy, load: list[tuple[float, float]], start: Replicas
) -> list[tuple[float, Replicas]]:
    """Simulate the planner every interval over a capacity model: each prefill engine holds TTFT at its target
    for one unit of prompt load, each decode engine holds TPOT at its target for two; latency grows with the
    load per engine. ``load``: (from time, load) steps. Replicas change at once (engines start instantly)."""
    replicas, history, trace = start, [], []
    for step in range(int(load[-1][0] / INTERVAL_S) + 60):
        now = step * INTERVAL_S
        level = next(level for since, level in reversed(load) if now >= since)
        ttft = TARGETS.ttft_s * level / max(replicas.prefill, 1e-9)
        tpot = TARGETS.tpot_s * level / 2 / max(replicas.decode, 1e-9)
        history.append(Sample(now, replicas.prefill, replicas.decode, ttft_s=ttft, tpot_s=tpot))
        replicas = plan(policy, history, replicas, now).replicas
        trace.append((now, replicas))
    return trace


def test_a_closed_loop_follows_a_ramp_and_settles_without_flapping() -> None:
    trace = closed_loop(POLICY, [(0.0, 2.0), (300.0, 6.0), (900.0, 2.0)], Replicas(1, 1))
    by_time = dict(trace)
    # the first ramp step: prefill needs 2 of capacity 1 each, decode 1 of capacity 2; both within a window
    assert by_time[60.0] == Replicas(2, 1)
    assert by_time[300.0 + UP_S + INTERVAL_S] == Replicas(6, 3)
    # down in halves, a scale-down window at each count: 6 -> 3 prefill, then the 2 the load needs
    assert by_time[900.0 + DOWN_S + 2 * INTERVAL_S] == Replicas(3, 2)
    assert by_time[900.0 + 2 * DOWN_S + 5 * INTERVAL_S] == Replicas(2, 1)
    # between the steps, once settled, nothing moves
    for start, end in ((100.0, 300.0), (400.0, 900.0), (1150.0, trace[-1][0])):
        settled = {replicas for at, replicas in trace if start <= at < end}
        assert len(settled) == 1, (start, end, settled)
    changes = sum(a != b for (_, a), (_, b) in itertools.pairwise(trace))
    assert changes <= 5


def test_policies_that_cannot_hold_their_ratio_or_bounds_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="minReplicas 3 and maxReplicas 2"):
        RoleBounds(3, 2)
    with pytest.raises(ValueError, match="keep the ratio"):
        Policy(RoleBounds(4, 4), RoleBounds(1, 1), TARGETS, 0.5, 2.0)
    with pytest.raises(ValueError, match="ratio range"):
        Policy(RoleBounds(1, 4), RoleBounds(1, 4), TARGETS, 2.0, 1.0)
    with pytest.raises(ValueError, match="decode needs a target"):
        Targets(ttft_s=1.0)
    with pytest.raises(ValueError, match="windows"):
        Policy(
            RoleBounds(1, 4),
            RoleBounds(1, 4),
            TARGETS,
            0.5,
            2.0,
            scale_up_window_s=60,
            scale_down_window_s=30,
        )
    assert math.isclose(POLICY.ratio_max, 2.0)
