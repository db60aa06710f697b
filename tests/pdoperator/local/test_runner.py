"""pdctl up starts real processes that serve; pdctl down stops exactly those."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from pdoperator.local import read_state
from pdoperator.local.runner import is_running

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "tiny-cpu.yaml"
PDCTL = str(Path(sys.executable).parent / "pdctl")


def pdctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PDCTL, *args], capture_output=True, text=True, timeout=180, check=False)


@pytest.fixture
def state_dir(tmp_path):
    yield tmp_path / "state"
    pdctl("down", "-f", str(TINY), "--state-dir", str(tmp_path / "state"))


def test_up_serves_through_the_router_and_down_stops_every_process(state_dir):
    result = pdctl("up", "-f", str(TINY), "--mode", "pull", "--state-dir", str(state_dir))
    assert result.returncode == 0, result.stderr
    endpoint = result.stdout.strip().splitlines()[-1].split(": ")[1].split("/v1")[0]
    assert "is up in pull mode" in result.stdout
    processes = read_state(state_dir)
    assert [p.name for p in processes] == ["tiny-prefill-0", "tiny-decode-0", "tiny-router"]
    request = urllib.request.Request(
        f"{endpoint}/v1/completions",
        data=json.dumps({"model": "tiny-llama", "prompt": "t1 t2 t3", "max_tokens": 4}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["x-pd-prefill"] == "tiny-prefill-0"
        assert response.headers["x-pd-decode"] == "tiny-decode-0"
        assert json.loads(response.read())["kv_transfer_params"]["pd_received"]["bytes"] > 0

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
    result = pdctl("up", "-f", str(REPO / "examples" / "qwen3-32b-push-efa.yaml"), "--state-dir", str(state_dir))
    assert result.returncode == 1
    assert "spec.engine.runtime is vllm" in result.stderr
    assert "Traceback" not in result.stderr
    assert read_state(state_dir) == []
