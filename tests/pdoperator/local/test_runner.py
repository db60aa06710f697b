"""pdctl up starts real processes that serve; pdctl down stops exactly those."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from pdoperator.local import read_state, runner
from pdoperator.local.runner import RunningProcess, is_running

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "tiny-cpu.yaml"
PDCTL = str(Path(sys.executable).parent / "pdctl")


def pdctl(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PDCTL, *args], capture_output=True, text=True, timeout=timeout_s, check=False)


def complete(endpoint: str, body: dict[str, object]) -> tuple[dict[str, str], dict]:
    request = urllib.request.Request(
        f"{endpoint}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return dict(response.headers), json.loads(response.read())


def endpoint_of(up_output: str) -> str:
    return up_output.strip().splitlines()[-1].split(": ")[1].split("/v1")[0]


@pytest.fixture
def state_dir(tmp_path):
    yield tmp_path / "state"
    pdctl("down", "-f", str(TINY), "--state-dir", str(tmp_path / "state"))


def test_up_serves_through_the_router_and_down_stops_every_process(state_dir):
    result = pdctl("up", "-f", str(TINY), "--mode", "pull", "--state-dir", str(state_dir))
    assert result.returncode == 0, result.stderr
    endpoint = endpoint_of(result.stdout)
    assert "is up in pull mode" in result.stdout
    processes = read_state(state_dir)
    assert [p.name for p in processes] == ["tiny-prefill-0", "tiny-decode-0", "tiny-router"]
    headers, body = complete(endpoint, {"model": "tiny-llama", "prompt": "t1 t2 t3", "max_tokens": 4})
    assert (headers["x-pd-prefill"], headers["x-pd-decode"]) == ("tiny-prefill-0", "tiny-decode-0")
    assert body["kv_transfer_params"]["pd_received"]["bytes"] > 0

    again = pdctl("up", "-f", str(TINY), "--state-dir", str(state_dir))
    assert again.returncode != 0
    assert "already up" in again.stderr

    stopped = pdctl("down", "-f", str(TINY), "--state-dir", str(state_dir))
    assert stopped.returncode == 0
    assert "stopped 3 processes" in stopped.stdout
    assert not any(is_running(p) for p in processes)


def test_down_without_up_stops_nothing(state_dir):
    result = pdctl("down", "-f", str(TINY), "--state-dir", str(state_dir))
    assert result.returncode == 0
    assert "stopped 0 processes" in result.stdout


def test_up_of_a_gpu_example_fails_clearly_without_starting_anything(state_dir):
    result = pdctl(
        "up", "-f", str(REPO / "examples" / "qwen3-32b-push-efa.yaml"), "--state-dir", str(state_dir)
    )
    assert result.returncode == 1
    assert "spec.engine.runtime is vllm" in result.stderr
    assert "Traceback" not in result.stderr
    assert read_state(state_dir) == []


def test_up_with_vllm_engines_serves_through_our_connector_and_down_stops_the_engines_process_groups(
    state_dir,
):
    result = pdctl("up", "-f", str(TINY), "--engine", "vllm", "--state-dir", str(state_dir), timeout_s=900)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "is up in push mode" in result.stdout and (state_dir / "tiny-model" / "model.safetensors").exists()
    endpoint = endpoint_of(result.stdout)
    prompt = " ".join(f"t{i}" for i in range(200))  # more than one 128-token block
    headers, body = complete(
        endpoint, {"model": "tiny-llama", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    )
    assert (headers["x-pd-prefill"], headers["x-pd-decode"]) == ("tiny-prefill-0", "tiny-decode-0")
    assert body["usage"]["prompt_tokens"] == 200 and body["usage"]["completion_tokens"] == 4
    with urllib.request.urlopen(f"{endpoint}/status", timeout=10) as response:
        assert json.loads(response.read())["transfers"] == {
            "verified": 1,
            "unverified": 0,
            "unconfirmable": 0,
        }
    processes = read_state(state_dir)
    stopped = pdctl("down", "-f", str(TINY), "--state-dir", str(state_dir), timeout_s=120)
    assert "stopped 3 processes" in stopped.stdout
    # vLLM's engine core and workers are children in each engine's process group: none may outlive down.
    assert [live_members(process.pid) for process in processes] == [[]] * len(processes)


def test_down_also_stops_what_of_a_process_group_outlives_its_leader(tmp_path, monkeypatch):
    """As vLLM's workers may: the leader ends on SIGTERM, its child ignores it; down waits for the whole
    group and kills the rest at its deadline."""
    monkeypatch.setattr(runner, "STOP_TIMEOUT_S", 1.0)
    ready = tmp_path / "child-ready"
    child = (
        "import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"pathlib.Path({str(ready)!r}).touch(); time.sleep(120)"
    )
    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); "
            "time.sleep(120)",
        ],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the child never started"
        ticks = int(Path(f"/proc/{leader.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        state_dir = tmp_path / "state"
        state_dir.mkdir()
        runner._write_state(
            state_dir, [RunningProcess("engine", leader.pid, ticks, "http://127.0.0.1:1", "log")]
        )

        assert runner.down(state_dir) == ["engine"]
        leader.wait(timeout=10)
        assert live_members(leader.pid) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, 9)
        leader.wait(timeout=10)


def live_members(process_group: int) -> list[str]:
    """Processes of a group that still run (zombies are dead: reaping them is their new parent's business)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, fields = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        state, _, pgid = fields.split()[:3]
        if int(pgid) == process_group and state not in {"Z", "X"}:
            members.append(name.split("(", 1)[1])
    return members


def test_up_autoscale_needs_spec_autoscaling_and_starts_nothing_without_it(state_dir):
    result = pdctl("up", "--autoscale", "-f", str(TINY), "--state-dir", str(state_dir))
    assert result.returncode != 0
    assert "--autoscale needs spec.autoscaling" in result.stderr
    assert read_state(state_dir) == []


def test_up_autoscale_runs_in_the_foreground_and_sigterm_stops_everything_it_started(state_dir):
    scaled = REPO / "examples" / "tiny-autoscaled.yaml"
    command = [PDCTL, "up", "--autoscale", "-f", str(scaled), "--state-dir", str(state_dir)]
    process = subprocess.Popen(
        [*command, "--autoscale-interval", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("autoscaling;"):
                break
        running = read_state(state_dir)
        assert [p.name for p in running] == [
            "tiny-autoscaled-prefill-0",
            "tiny-autoscaled-decode-0",
            "tiny-autoscaled-router",
        ], "".join(lines)
        rounds = state_dir / "autoscale.jsonl"
        deadline = time.monotonic() + 30
        while (
            time.monotonic() < deadline
            and len(rounds.read_text().splitlines() if rounds.exists() else []) < 2
        ):
            time.sleep(0.2)
        first = json.loads(rounds.read_text().splitlines()[0])
        assert first["prefill"] == first["decode"] == {"replicas": 1, "serving": 1}
        process.terminate()
        assert process.wait(timeout=30) == 0
        assert not any(is_running(p) for p in running)
        assert not (state_dir / "state.json").exists()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
