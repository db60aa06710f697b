"""scripts/run_reaped.py: a GPU suite step's time limit, and the end of every process the step left behind
(engines in sessions of their own survive their pytest otherwise, holding the GPU through the next step)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Starts a process in a session of its own, as the test harness starts an engine, prints its PID, then ends
# with the given status after the given seconds.
LEAVES_A_PROCESS = textwrap.dedent(
    """
    import subprocess, sys, time
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    print(engine.pid, flush=True)
    time.sleep(float(sys.argv[1]))
    sys.exit(int(sys.argv[2]))
    """
)


def run_reaped(limit_s: float, sleep_s: float, status: int) -> tuple[int, int, str]:
    """(exit status, the left process's PID, stderr)."""
    command = [sys.executable, "-c", LEAVES_A_PROCESS, str(sleep_s), str(status)]
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "run_reaped.py"), str(limit_s), *command],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done.returncode, int(done.stdout.split()[0]), done.stderr


def alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_command_that_ends_in_time_keeps_its_status_and_what_it_left_running_is_ended() -> None:
    status, engine, stderr = run_reaped(limit_s=60, sleep_s=0, status=3)
    assert status == 3
    assert not alive(engine)
    assert f"ended 1 processes left behind: [{engine}]" in stderr


def test_a_command_past_its_limit_exits_124_and_its_processes_are_ended_with_it() -> None:
    status, engine, stderr = run_reaped(limit_s=1, sleep_s=300, status=0)
    assert status == 124
    assert not alive(engine)
    assert "ran past 1 s" in stderr


def test_without_a_command_it_prints_its_usage() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "run_reaped.py")], capture_output=True, text=True, check=False
    )
    assert done.returncode == 2 and "usage: python3 scripts/run_reaped.py SECONDS COMMAND" in done.stderr
