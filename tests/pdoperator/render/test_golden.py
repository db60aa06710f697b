"""Golden files pin the rendered output of every example: a rendering change shows up as a diff.

Regenerate after an intended change with ``make golden`` (PD_UPDATE_GOLDEN=1 pytest
tests/pdoperator/render), then review the diff of tests/pdoperator/render/golden/.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest
from pdoperator.render import RenderDefaults, render_pdservice
from pdoperator.render.manifest_yaml import dump_manifests

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("PD_UPDATE_GOLDEN") == "1"


def test_rendered_example_matches_its_golden_file(example):
    name, pds = example
    rendered = dump_manifests(render_pdservice(pds, RenderDefaults()))
    golden = GOLDEN / f"{name}.yaml"
    if UPDATE:
        golden.write_text(rendered, encoding="utf-8")
        return
    if not golden.exists():
        pytest.fail(f"no golden file {golden}; create it with `make golden`")
    expected = golden.read_text(encoding="utf-8")
    if rendered != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(True),
                rendered.splitlines(True),
                f"golden/{name}.yaml",
                f"rendered {name}",
            )
        )
        advice = "If the change is intended, run `make golden` and commit the updated golden files."
        pytest.fail(f"rendering of examples/{name}.yaml changed:\n{diff}\n{advice}", pytrace=False)


def test_every_golden_file_belongs_to_an_example():
    examples = {path.stem for path in (Path(__file__).resolve().parents[3] / "examples").glob("*.yaml")}
    assert {path.stem for path in GOLDEN.glob("*.yaml")} <= examples
