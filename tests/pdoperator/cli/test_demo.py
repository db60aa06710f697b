"""pdctl demo: validates and renders every example and prints a summary per example."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import yaml
from pdoperator.cli.main import main

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "examples"


def pdctl(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def block(out: str, example: str) -> str:
    """The summary lines of one example."""
    start = out.index(f"{example}: PDService")
    end = out.find("\n\n", start)
    return out[start:end]


def test_demo_summarises_every_repository_example_and_exits_0():
    code, out, err = pdctl("demo", "--local-run", "")
    assert (code, err) == (0, "")
    for path in EXAMPLES.glob("*.yaml"):
        assert f"{path.name}: PDService" in out
    count = len(list(EXAMPLES.glob("*.yaml")))
    assert out.rstrip().endswith(f"{count} examples: {count} ok, 0 failed")


def test_demo_shows_mode_model_replicas_tp_gpus_efa_connector_transport_and_objects():
    _, out, _ = pdctl("demo", "--examples", str(EXAMPLES), "--local-run", "")
    qwen = block(out, "qwen3-32b-push-efa.yaml")
    assert "PDService inference/qwen3-32b: ok" in qwen
    assert re.search(r"mode\s+push", qwen)
    assert "Qwen/Qwen3-32B as 'qwen3-32b'" in qwen
    assert re.search(r"prefill\s+1 x TP8\s+8\s+16\s", qwen)
    assert re.search(r"decode\s+1 x TP8\s+8\s+16\s", qwen)
    assert "builtin pdconnector.vllm.connector.PDConnector" in qwen
    assert "LIBFABRIC over EFA (IPC_LOCK" in qwen
    assert (
        "objects    12: NetworkPolicy 2, PodDisruptionBudget 3, ConfigMap 1, Service 3, Deployment 1, "
        "StatefulSet 2" in qwen
    )
    assert "12/12 valid for Kubernetes 1.35.0" in qwen
    hybrid = block(out, "nemotron-nano-hybrid.yaml")
    assert re.search(r"prefill\s+2 x TP1\s+1\s+0\s", hybrid)
    assert re.search(r"decode\s+1 x TP2\s+2\s+0\s", hybrid)
    assert "mamba2 conv layout DS" in hybrid
    tiny = block(out, "tiny-cpu.yaml")
    assert "engine runtime mock" in tiny
    assert re.search(r"prefill\s+1 x TP1\s+0\s+0\s", tiny)


def test_an_invalid_example_is_reported_with_its_field_and_fails_the_demo(tmp_path):
    shutil.copy(EXAMPLES / "tiny-cpu.yaml", tmp_path / "good.yaml")
    bad = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    bad["spec"]["decode"]["tensorParallelSize"] = 0
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    (tmp_path / "notes.txt").write_text("not an example")
    code, out, _ = pdctl("demo", "--examples", str(tmp_path), "--local-run", "")
    assert code == 1
    assert "bad.yaml: INVALID" in out
    assert "spec.decode.tensorParallelSize" in out
    assert "good.yaml: PDService default/tiny: ok" in out
    assert out.rstrip().endswith("2 examples: 1 ok, 1 failed")


def test_a_missing_or_empty_examples_directory_exits_1(tmp_path):
    code, _, err = pdctl("demo", "--examples", str(tmp_path / "absent"))
    assert code == 1
    assert "no such directory" in err
    code, _, err = pdctl("demo", "--examples", str(tmp_path))
    assert code == 1
    assert "no *.yaml examples" in err


def test_the_installed_pdctl_runs_the_demo_from_any_directory(tmp_path):
    pdctl_script = Path(sys.executable).parent / "pdctl"
    result = subprocess.run(
        [str(pdctl_script), "demo", "--local-run", ""],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    count = len(list(EXAMPLES.glob("*.yaml")))
    assert f"{count} examples: {count} ok, 0 failed" in result.stdout
    assert "Traceback" not in result.stderr


def test_the_readme_main_job_runs_the_tiny_example_locally_in_both_modes():
    """`make demo`, the README's first command: render every example, then serve requests through a local P/D
    run."""
    result = subprocess.run(
        ["make", "--no-print-directory", "demo"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for mode in ("push", "pull"):
        section = out[out.index(f"  {mode} mode via http://127.") :]
        rows = [line.split() for line in section.splitlines()[2:5]]
        assert [(row[2], row[3]) for row in rows] == [("tiny-prefill-0", "tiny-decode-0")] * 3
        assert all(int(row[4]) > 0 for row in rows), "every request moved KV bytes"
        assert "router verified 3 transfers, 0 served without one" in section
    push_texts = [line.split(maxsplit=5)[5] for line in out[out.index("  push mode") :].splitlines()[2:5]]
    pull_texts = [line.split(maxsplit=5)[5] for line in out[out.index("  pull mode") :].splitlines()[2:5]]
    assert push_texts == pull_texts, "both modes generate the same tokens from the same transferred KV"
