"""The autoscaler's closed loop, short form: `pdctl up --autoscale` under a 2 -> 12 -> 2 QPS ramp of 1k-token
prompts (``e2e/bench/autoscale_ramp.py --short``, as its own process).

What must hold: no request fails, scale-down included; the ratio range and the bounds hold at every round;
after the step up, TTFT p90 is back within its target within 20 s (the scale-up window, engine start-up, and
draining the queue that built before); both roles scale up under the step and back down after it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SETTLE_BOUND_S = 20.0


@pytest.mark.slow
def test_a_load_ramp_scales_both_roles_up_and_down_within_targets_and_fails_no_request(
    tmp_path: Path,
) -> None:
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "e2e" / "bench" / "autoscale_ramp.py"),
            "--short",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads((tmp_path / "ramp.json").read_text())
    print(run.stdout[-3000:])  # shown when the test fails

    assert report["failed"] == 0, report["failures"]
    assert report["ratio_violations"] == []
    step_up = next(step for step in report["settle"] if step["qps"] == 12)
    assert step_up["settle_s"] <= SETTLE_BOUND_S
    rounds = report["rounds"]
    for role in ("prefill", "decode"):
        serving = [entry[role]["serving"] for entry in rounds]
        assert max(serving) > serving[0], f"{role} never scaled up"
        peak = serving.index(max(serving))
        assert min(serving[peak:]) < max(serving), f"{role} never scaled down"
