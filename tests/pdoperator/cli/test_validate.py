"""pdctl validate: OK lines, errors with field paths, exit codes, and no traceback for any input."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pdoperator.cli import validate

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

GOOD = """\
apiVersion: inference.pdoperator.dev/v1alpha1
kind: PDService
metadata: {name: good, namespace: ml}
spec:
  model: {name: m}
"""
BAD = """\
apiVersion: inference.pdoperator.dev/v1alpha1
kind: PDService
metadata: {name: bad}
spec:
  model: {name: m, architecture: hybrid-ssm}
  prefill: {tensorParallelSize: 0}
---
apiVersion: inference.pdoperator.dev/v1alpha1
kind: PDService
metadata: {name: bad2}
spec:
  model: {name: m, architecture: hybrid-ssm}
  network: {efa: {enabled: true, prefillDevices: 1, decodeDevices: 1, hugepages: "0"}}
  ssm: {family: mamba2}
"""


def run_validate(capsys, *files: str) -> tuple[int, list[str], list[str]]:
    parser = argparse.ArgumentParser()
    validate.add_arguments(parser)
    status = validate.run(parser.parse_args([arg for name in files for arg in ("-f", name)]))
    captured = capsys.readouterr()
    return status, captured.out.splitlines(), captured.err.splitlines()


def write(tmp_path: Path, name: str, content: str | bytes) -> str:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


def test_every_example_is_ok(capsys):
    status, out, err = run_validate(capsys, *map(str, EXAMPLES))
    assert (status, err) == (0, [])
    assert out == [
        "OK inference/deepseek-v3",
        "OK inference/nemotron-nano",
        "OK inference/qwen3-32b",
        "OK default/tiny-autoscaled",
        "OK default/tiny",
        "OK default/tiny-gpu-vllm",
        "OK default/tiny-gpu",
    ]


def test_invalid_documents_print_each_error_with_its_field_path(capsys, tmp_path):
    good, bad = write(tmp_path, "good.yaml", GOOD), write(tmp_path, "bad.yaml", BAD)
    status, out, err = run_validate(capsys, good, bad)
    assert status == 1
    assert out == ["OK ml/good"]
    assert err == [
        f"{bad}: default/bad: spec.prefill.tensorParallelSize: must be at least 1 (got 0)",
        f"{bad}: default/bad2: spec.engine.transport.backend: must be LIBFABRIC when "
        "spec.network.efa.enabled is true "
        "(UCX on EFA silently falls back to TCP)",
    ]


def test_other_kinds_are_skipped(capsys, tmp_path):
    secret = "apiVersion: v1\nkind: Secret\nmetadata: {name: hf-token}\n---\n" + GOOD
    status, out, _ = run_validate(capsys, write(tmp_path, "both.yaml", secret))
    assert status == 0
    assert out == [
        f"SKIP {tmp_path / 'both.yaml'}: default/hf-token: v1 Secret is not a PDService",
        "OK ml/good",
    ]


def test_a_document_of_our_group_with_another_kind_is_an_error(capsys, tmp_path):
    path = write(tmp_path, "kind.yaml", GOOD.replace("kind: PDService", "kind: PDServise"))
    status, _, err = run_validate(capsys, path)
    assert (status, err) == (1, [f'{path}: ml/good: kind: must be PDService (got "PDServise")'])


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("", "no PDService documents (PDService, apiVersion inference.pdoperator.dev/...)"),
        ("# nothing here\n", "no PDService documents (PDService, apiVersion inference.pdoperator.dev/...)"),
        ("- a\n- b\n", "document 1: must be a mapping (a Kubernetes object), got a list"),
        ("42\n", "document 1: must be a mapping (a Kubernetes object), got a number"),
        (
            "key: [unclosed\n",
            "yaml: line 2, column 1: did not find expected ',' or ']' (while parsing a flow sequence)",
        ),
        (b"\x7fELF\x02\x01\x01\x00\xff\xfe", "yaml: not UTF-8 text (byte 8: b'\\xff')"),
        (
            "{apiVersion: inference.pdoperator.dev/v1alpha1, kind: PDService}\n",
            "document 1: metadata: required",
        ),
    ],
    ids=["empty", "comment only", "list", "scalar", "not yaml", "binary", "no metadata"],
)
def test_garbage_input_gets_a_clear_error(capsys, tmp_path, content, expected):
    path = write(tmp_path, "garbage.yaml", content)
    status, _, err = run_validate(capsys, path)
    assert status == 1
    assert err[0] == f"{path}: {expected}"


def test_an_unreadable_file_exits_2(capsys, tmp_path):
    missing = str(tmp_path / "missing.yaml")
    status, _, err = run_validate(capsys, write(tmp_path, "bad.yaml", BAD), missing, str(tmp_path))
    assert status == 2
    assert err[-2:] == [
        f"{missing}: cannot read: No such file or directory",
        f"{tmp_path}: cannot read: Is a directory",
    ]


def test_stdin_and_real_process_exit_codes_without_tracebacks(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "pdoperator.cli.main", "validate", "-f", "-"],
        input=GOOD.encode(),
        capture_output=True,
        check=False,
        timeout=120,
    )
    assert (ok.returncode, ok.stdout.decode(), ok.stderr.decode()) == (0, "OK ml/good\n", "")
    garbage = subprocess.run(
        [sys.executable, "-m", "pdoperator.cli.main", "validate", "-f", "-", "-f", str(tmp_path / "nope")],
        input=b"\x00\x01binary: [",
        capture_output=True,
        check=False,
        timeout=120,
    )
    assert garbage.returncode == 2
    assert "Traceback" not in garbage.stderr.decode()
    assert garbage.stderr.decode().splitlines() == [
        "<stdin>: yaml: position 0: unacceptable character #x0000: control characters are not allowed",
        f"{tmp_path / 'nope'}: cannot read: No such file or directory",
    ]


def test_names_that_would_break_the_output_lines_are_quoted(capsys, tmp_path):
    other = 'apiVersion: v1\nkind: "Con\\nfigMap"\nmetadata: {name: "a\\nb"}\n---\n'
    path = write(tmp_path, "odd.yaml", other + GOOD.replace("name: good", 'name: "x\\ny"'))
    status, out, err = run_validate(capsys, path)
    assert status == 1
    assert out == [f'SKIP {path}: default/"a\\nb": "v1 Con\\nfigMap" is not a PDService']
    assert err[0].startswith(f'{path}: ml/"x\\ny": metadata.name: must start with a lowercase letter')


_YAML_TOKENS = [*"{}[]:,-&*!|>'\"#%@?<= \n\tabk01.", "spec", "model", "name", "apiVersion", "\n  ", "---\n"]
_YAMLISH = st.lists(st.sampled_from(_YAML_TOKENS), max_size=60).map("".join)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    content=st.binary(max_size=120)
    | _YAMLISH.map(str.encode)
    | _YAMLISH.map(lambda text: (GOOD + text).encode())
)
def test_any_file_content_gives_an_exit_status_not_a_traceback(tmp_path, content):
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(content)
    out, err = io.StringIO(), io.StringIO()
    assert validate.validate_file(str(path), out, err) in (0, 1)
    assert out.getvalue() or err.getvalue()
