"""pdctl crd prints exactly the committed CRD (what `make crd` writes)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from pdoperator.api import crd_yaml
from pdoperator.cli import crd

COMMITTED = Path(__file__).resolve().parents[3] / "crds" / "pdservices.inference.pdoperator.dev.yaml"


def test_run_prints_the_generated_crd(capsys):
    parser = argparse.ArgumentParser()
    crd.add_arguments(parser)
    assert crd.run(parser.parse_args([])) == 0
    assert capsys.readouterr().out == crd_yaml()


def test_pdctl_crd_output_is_the_committed_file():
    result = subprocess.run(
        [sys.executable, "-m", "pdoperator.cli.main", "crd"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == COMMITTED.read_text(), "crds/ drifted from pdoperator.api: run `make crd`"
