"""Start and stop a local plan: detached processes, a state file, logs.

`pdctl up` returns once every process is healthy and leaves them running; the state file
(``<state dir>/state.json``) records each process with its start time, so `pdctl down`
stops exactly what `up` started even if a PID has since been reused by something else.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdconnector.sim.cluster import Process

from pdoperator.render import ComponentRole

from .plan import ROUTER_CONFIG_FILE, LocalPlan, LocalProcess

STATE_FILE = "state.json"
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RunningProcess:
    name: str
    pid: int
    start_ticks: int
    url: str
    log: str


def default_state_dir(namespace: str, name: str) -> Path:
    return Path(os.environ.get("PDCTL_STATE_DIR", ".pdctl")) / f"{namespace}.{name}"


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None once it has
    exited."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, *fields = stat.rsplit(")", 1)[1].split()
    return None if state in {"Z", "X"} else int(fields[18])


def read_state(state_dir: Path) -> list[RunningProcess]:
    path = state_dir / STATE_FILE
    if not path.exists():
        return []
    return [RunningProcess(**item) for item in json.loads(path.read_text())["processes"]]


def is_running(process: RunningProcess) -> bool:
    return _start_ticks(process.pid) == process.start_ticks


def up(plan: LocalPlan, state_dir: Path) -> list[RunningProcess]:
    """Start every process of ``plan`` and wait until each answers /health; on any failure stop them all."""
    if any(is_running(process) for process in read_state(state_dir)):
        raise RuntimeError(
            f"{plan.namespace}/{plan.name} is already up (state in {state_dir}); run `pdctl down` first"
        )
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / ROUTER_CONFIG_FILE).write_text(plan.router_config)
    started: list[RunningProcess] = []

    def start(local: LocalProcess) -> Process:
        process = Process(
            local.name, list(local.argv), local.url, state_dir / f"{local.name}.log", env=dict(local.env)
        )
        process.start()
        assert process.popen is not None
        started.append(
            RunningProcess(
                local.name,
                process.popen.pid,
                _start_ticks(process.popen.pid) or 0,
                local.url,
                str(process.log_path),
            )
        )
        _write_state(state_dir, started)
        return process

    engines = [local for local in plan.processes if local.role is not ComponentRole.ROUTER]
    routers = [local for local in plan.processes if local.role is ComponentRole.ROUTER]
    try:
        # Engines boot side by side (a vLLM engine takes most of a minute), the router once they answer.
        for local, process in [(local, start(local)) for local in engines]:
            process.wait_healthy(local.startup_timeout_s)
        for local in routers:
            start(local).wait_healthy(local.startup_timeout_s)
    except BaseException:
        down(state_dir)
        raise
    return started


def _write_state(state_dir: Path, processes: list[RunningProcess]) -> None:
    (state_dir / STATE_FILE).write_text(json.dumps({"processes": [asdict(p) for p in processes]}, indent=2))


def down(state_dir: Path) -> list[str]:
    """Stop every process the state file names (SIGTERM, then SIGKILL after a deadline); returns their
    names."""
    processes = [process for process in read_state(state_dir) if is_running(process)]
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline and any(is_running(process) for process in processes):
        time.sleep(0.05)
    for process in processes:
        if is_running(process):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(FileNotFoundError):
        (state_dir / STATE_FILE).unlink()
    return [process.name for process in processes]
