"""What of the kind suite can be checked without a cluster: its cluster config, script and CI workflow."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
KIND = REPO / "e2e" / "kind"


def test_cluster_has_two_workers_so_prefill_and_decode_can_be_on_different_nodes() -> None:
    cluster = yaml.safe_load((KIND / "cluster.yaml").read_text())
    assert cluster["kind"] == "Cluster"
    roles = [node["role"] for node in cluster["nodes"]]
    assert roles.count("worker") >= 2
    assert all(node["image"].startswith("kindest/node:v1.35") for node in cluster["nodes"])


def test_run_script_is_valid_bash_that_installs_the_chart_and_runs_the_kind_marker() -> None:
    script = KIND / "run.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "helm upgrade --install" in text
    assert "charts/pd-operator" in text
    assert "-m kind tests/e2e/kind" in text


def test_ci_workflow_runs_the_kind_script() -> None:
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "kind.yml").read_text())
    steps = workflow["jobs"]["kind"]["steps"]
    assert any(step.get("run") == "e2e/kind/run.sh" for step in steps)
    assert any(step.get("uses", "").startswith("helm/kind-action") for step in steps)
