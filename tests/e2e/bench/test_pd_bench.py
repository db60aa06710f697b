"""The serving benchmark (``e2e/bench/pd_bench.py``, as its own process) on mock engines: what a run records,
and that a time budget leaves out what would not end within it and says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SMALL_SWEEP = ["--engine", "mock", "--variants", "mock-push", "--input-lens", "64", "--output-len", "4"]


def pd_bench(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "e2e" / "bench" / "pd_bench.py"), "--out", str(out), *SMALL_SWEEP, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_a_run_within_the_budget_records_its_figures_and_the_points_that_ran(tmp_path: Path) -> None:
    sweep = ["--qps", "8", "--seconds", "1", "--min-prompts", "6", "--budget-s", "240"]
    run = pd_bench(tmp_path, *sweep, "--warmup-requests", "3")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    figures = json.loads((tmp_path / "mock-push-in64-qps8.json").read_text())
    assert (figures["completed"], figures["failed"]) == (8, 0)  # the 3 warm-up requests are not counted
    assert run.stdout.count("Successful requests:") == 2  # the warm-up burst, then the run
    assert 0 < figures["p50_ttft_ms"] <= figures["p99_ttft_ms"]
    assert figures["stages_mean_ms"]  # where the time went, from the router's and engines' /metrics
    points = json.loads((tmp_path / "points.json").read_text())
    assert [(p["label"], p["input_len"], p["qps"], p["saturated"]) for p in points["ran"]] == [
        ("mock-push", 64, 8.0, False)
    ]
    assert (points["running"], points["left_out"]) == (None, [])
    assert (tmp_path / "ttft_vs_qps.png").exists() and "| mock-push | 64 | 8 |" in run.stdout


def test_points_that_cannot_end_within_the_budget_are_left_out_and_listed(tmp_path: Path) -> None:
    run = pd_bench(tmp_path, "--qps", "1,2", "--seconds", "4", "--budget-s", "3")
    assert run.returncode == 1  # nothing ran: no figures to draw
    points = json.loads((tmp_path / "points.json").read_text())
    assert points["ran"] == []
    assert [(p["label"], p["input_len"], p["qps"]) for p in points["left_out"]] == [
        ("mock-push", 64, 1.0),
        ("mock-push", 64, 2.0),
    ]
    assert all("time budget" in p["why"] for p in points["left_out"])
    assert not (tmp_path / "state").exists()  # no engine was started


@pytest.mark.slow
def test_no_higher_rate_follows_a_run_its_engines_could_not_keep_up_with(tmp_path: Path) -> None:
    # one prompt of 64 tokens takes prefill 0.64 s: 8 arriving within a second queue for five
    slow_prefill = [
        "--prefill-s-per-token",
        "0.01",
        "--seconds",
        "1",
        "--min-prompts",
        "8",
        "--drain-s",
        "0.1",
    ]
    run = pd_bench(tmp_path, "--qps", "8,16", *slow_prefill)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    points = json.loads((tmp_path / "points.json").read_text())
    (ran,) = points["ran"]
    assert (ran["qps"], ran["saturated"]) == (8.0, True) and ran["seconds"] > 5
    (left_out,) = points["left_out"]
    assert left_out["qps"] == 16.0 and left_out["why"].startswith("saturated")
