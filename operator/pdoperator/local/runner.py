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
from collections.abc import Collection, Sequence
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


@dataclass(frozen=True)
class _Stat:
    state: str  # R, S, ...; Z once exited but not yet reaped
    process_group: int
    start_ticks: int  # clock ticks since boot: with the PID, names one process for good

    @property
    def exited(self) -> bool:
        return self.state in {"Z", "X"}


def _stat(pid: int | str) -> _Stat | None:
    """/proc/PID/stat fields 3, 5 and 22; None once nothing holds the PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, _, process_group, *fields = stat.rsplit(")", 1)[1].split()
    return _Stat(state, int(process_group), int(fields[16]))


def _start_ticks(pid: int) -> int | None:
    """The process's start time; None once it has exited."""
    stat = _stat(pid)
    return None if stat is None or stat.exited else stat.start_ticks


def read_state(state_dir: Path) -> list[RunningProcess]:
    path = state_dir / STATE_FILE
    if not path.exists():
        return []
    return [RunningProcess(**item) for item in json.loads(path.read_text())["processes"]]


def is_running(process: RunningProcess) -> bool:
    return _start_ticks(process.pid) == process.start_ticks


def _group_alive(process: RunningProcess) -> bool:
    """Whether anything of the process group the process leads still runs: vLLM's engine core and workers
    are its children there and may outlive the API server by seconds. Once the leader's PID belongs to
    another process the group is not ours to judge; while it is unused or the leader's zombie holds it, no
    other group can have that id (Linux does not hand out a PID that is still a process group's id)."""
    leader = _stat(process.pid)
    if leader is not None and leader.start_ticks != process.start_ticks:
        return False
    if leader is not None and not leader.exited:
        return True
    for entry in Path("/proc").iterdir():
        member = _stat(entry.name) if entry.name.isdigit() else None
        if member is not None and member.process_group == process.pid and not member.exited:
            return True
    return False


def up(plan: LocalPlan, state_dir: Path) -> list[RunningProcess]:
    """Start every process of ``plan`` and wait until each answers /health; on any failure stop them all."""
    if any(is_running(process) for process in read_state(state_dir)):
        raise RuntimeError(
            f"{plan.namespace}/{plan.name} is already up (state in {state_dir}); run `pdctl down` first"
        )
    state_dir.mkdir(parents=True, exist_ok=True)
    _write_state(state_dir, [])
    write_router_config(state_dir, plan.router_config)
    engines = [local for local in plan.processes if local.role is not ComponentRole.ROUTER]
    routers = [local for local in plan.processes if local.role is ComponentRole.ROUTER]
    try:
        # Engines boot side by side (a vLLM engine takes most of a minute), except those sharing a GPU; the
        # router once they answer.
        for wave in boot_waves(engines):
            start(wave, state_dir)
        start(routers, state_dir)
    except BaseException:
        down(state_dir)
        raise
    return read_state(state_dir)


def _gpus(local: LocalProcess) -> set[str]:
    return {gpu for gpu in local.env.get("CUDA_VISIBLE_DEVICES", "").split(",") if gpu.strip()}


def boot_waves(engines: Sequence[LocalProcess]) -> list[list[LocalProcess]]:
    """Engines in start order, grouped so no two of a group share a GPU. vLLM sizes its KV cache by profiling
    the GPU's memory while it starts and counts any other process's allocations in that time as its own: two
    engines starting side by side on one GPU left one of them a negative cache (seen on the H200)."""
    waves: list[list[LocalProcess]] = []
    for engine in engines:
        gpus = _gpus(engine)
        wave = next((w for w in waves if not gpus & set().union(*map(_gpus, w))), None)
        if wave is None:
            waves.append([engine])
        else:
            wave.append(engine)
    return waves


def write_router_config(state_dir: Path, text: str) -> None:
    """Replace the router's config file in one step (the router reloads it when it changes, and must never
    read half of it)."""
    path = state_dir / ROUTER_CONFIG_FILE
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    partial.replace(path)


def start(processes: Sequence[LocalProcess], state_dir: Path) -> list[RunningProcess]:
    """Start ``processes`` side by side, each recorded in the state file as it starts, and wait until each
    answers /health (raises on the first that exits or stays silent past its startup timeout)."""
    started = []
    for local in processes:
        process = Process(
            local.name, list(local.argv), local.url, state_dir / f"{local.name}.log", env=dict(local.env)
        )
        process.start()
        assert process.popen is not None
        running = RunningProcess(
            local.name,
            process.popen.pid,
            _start_ticks(process.popen.pid) or 0,
            local.url,
            str(process.log_path),
        )
        _write_state(state_dir, [*read_state(state_dir), running])
        started.append((local, process, running))
    for local, process, _ in started:
        process.wait_healthy(local.startup_timeout_s)
    return [running for _, _, running in started]


def _write_state(state_dir: Path, processes: list[RunningProcess]) -> None:
    (state_dir / STATE_FILE).write_text(json.dumps({"processes": [asdict(p) for p in processes]}, indent=2))


def stop(state_dir: Path, names: Collection[str] | None = None) -> list[str]:
    """Stop the processes the state file names (all, or those in ``names``) with their process groups:
    SIGTERM, then SIGKILL to what of a group still runs after a deadline; they leave the state file. Returns
    the names of those that were running."""
    if not (state_dir / STATE_FILE).exists():
        return []
    recorded = read_state(state_dir)
    leaving = [process for process in recorded if names is None or process.name in names]
    processes = [process for process in leaving if _group_alive(process)]
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline and any(_group_alive(process) for process in processes):
        time.sleep(0.05)
    for process in processes:
        if _group_alive(process):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    _write_state(state_dir, [process for process in recorded if process not in leaving])
    return [process.name for process in processes]


def down(state_dir: Path) -> list[str]:
    """Stop every process the state file names; returns their names."""
    stopped = stop(state_dir)
    with contextlib.suppress(FileNotFoundError):
        (state_dir / STATE_FILE).unlink()
    return stopped
