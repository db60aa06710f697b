"""pd-mock-engine's command line: where the KV pools live, and the combinations it refuses before starting."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pdconnector.sim.main import build_parser, main
from pdconnector.sim.pool import KVDevice, kv_device_unavailable_reason

ENGINE = ["--model", "tiny", "--engine-id", "e0", "--port", "0", "--log-format", "plain"]


def test_pools_live_in_host_memory_unless_asked_otherwise():
    assert build_parser().parse_args(["--role", "both", *ENGINE]).kv_device == "cpu"


@pytest.mark.skipif(
    kv_device_unavailable_reason(KVDevice.CUDA) is None, reason="this machine has a CUDA device"
)
def test_cuda_pools_without_a_cuda_device_exit_2_naming_the_flag():
    argv = [sys.executable, "-m", "pdconnector.sim.main", "--role", "both", "--kv-device", "cuda", *ENGINE]
    result = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--kv-device cuda" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_cuda_pools_over_the_mock_transport_are_refused(role, capsys):
    assert main(["--role", role, "--transport", "mock", "--kv-device", "cuda", *ENGINE]) == 2
    assert "--kv-device cuda needs --transport nixl" in capsys.readouterr().err


def test_a_request_spans_at_most_2048_tokens_unless_asked_otherwise():
    assert build_parser().parse_args(["--role", "both", *ENGINE]).max_model_len == 2048


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (
            ["--max-model-len", "1025", "--num-blocks", "64"],
            "--max-model-len 1025 is more than the KV pool holds (--num-blocks 64 x --block-size 16",
        ),
        (
            ["--max-model-len", "1"],
            "--max-model-len 1: a request needs room for at least one prompt and one output token",
        ),
    ],
)
def test_a_context_length_the_pool_cannot_serve_is_refused_before_starting(flags, says, capsys):
    assert main(["--role", "both", *ENGINE, *flags]) == 2
    assert says in capsys.readouterr().err
