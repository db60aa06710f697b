"""The fence's length follows from the liveness probe that kills a frozen engine
(pdconnector.protocol.liveness)."""

import pytest
from pdconnector.protocol.liveness import FENCE_SLACK_S, REGISTRATION_GRACE_S, LivenessProbe, fence_seconds


def test_a_frozen_engine_dies_within_stale_age_plus_failing_probes_plus_grace() -> None:
    probe = LivenessProbe(
        heartbeat_max_age_s=10, period_s=5, timeout_s=5, failure_threshold=2, termination_grace_s=5
    )
    assert probe.kill_bound_s() == 10 + 5 * 2 + 5 + 5


def test_the_fence_covers_a_post_within_the_lifetime_a_whole_write_and_two_kill_bounds() -> None:
    probe = LivenessProbe()
    assert (
        fence_seconds(30.0, probe) == REGISTRATION_GRACE_S + 30.0 + 2 * probe.kill_bound_s() + FENCE_SLACK_S
    )
    assert fence_seconds(60.0, probe) > fence_seconds(30.0, probe)


@pytest.mark.parametrize(
    "field", ["heartbeat_max_age_s", "period_s", "timeout_s", "failure_threshold", "termination_grace_s"]
)
def test_probe_settings_below_one_are_refused_by_name(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LivenessProbe(**{field: 0})


def test_a_write_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="write_timeout_s"):
        fence_seconds(0.0, LivenessProbe())
