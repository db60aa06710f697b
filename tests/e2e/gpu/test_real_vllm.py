"""Real vLLM engines on the GPU through `pdctl up` and the router (e2e/gpu/demo.py --engine vllm): push and
pull answers token-for-token equal to a co-located vLLM on the same GPU, every transfer counted on decode's
/metrics and verified by the router. Needs CUDA and vLLM importable (on the GPU machine: scripts/gpu-vllm.sh,
then scripts/gpu-suite.sh with PD_GPU_SUITE_STEPS=vllm); skips elsewhere with the reason."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
DEMO_TIMEOUT_S = 450


def _missing() -> str | None:
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device: real vLLM engines on the GPU need one"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not importable (GPU machine: scripts/gpu-vllm.sh, then . /tmp/pd-vllm/activate.sh)"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]


def test_push_and_pull_through_the_router_equal_colocated_vllm_with_every_transfer_counted(
    tmp_path, record_property
):
    logs = Path(os.environ.get("PD_GPU_SUITE_LOG_DIR", tmp_path)) / "real-vllm"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "e2e" / "gpu" / "demo.py"),
            str(logs),
            "--engine",
            "vllm",
            "--requests",
            "6",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        check=False,
    )
    written = logs / "gpu-demo.json"
    assert written.exists(), f"the demo wrote no report (exit {done.returncode}):\n{done.stderr[-4000:]}"
    report = json.loads(written.read_text())
    for mode, summary in report.get("modes", {}).items():
        record_property(f"{mode}_transfers_verified", summary["transfers_verified"])
        record_property(f"{mode}_bytes_moved", summary["bytes_moved"])
        record_property(f"{mode}_latency_p50_s", summary["latency_p50_s"])
    assert done.returncode == 0 and report["ok"], json.dumps(report, indent=1)[-6000:] + done.stderr[-2000:]
    for summary in report["modes"].values():
        assert summary["transfers_verified"] == 6 and summary["bytes_moved"] > 0
        assert len(summary["engines"]["prefill"]) == 1 and len(summary["engines"]["decode"]) == 1
