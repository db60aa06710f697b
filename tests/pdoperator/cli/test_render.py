"""pdctl render: manifests as YAML on stdout or into a directory; errors name the field, never a traceback."""

from __future__ import annotations

import io
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pdoperator.api import parse_pdservice
from pdoperator.cli.main import main
from pdoperator.render import RenderDefaults, render_pdservice

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def pdctl(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    real_stdin = sys.stdin
    if stdin is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode()))
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = main(list(args))
    finally:
        sys.stdin = real_stdin
    return code, out.getvalue(), err.getvalue()


def test_render_prints_every_manifest_as_a_yaml_stream():
    code, out, err = pdctl("render", "-f", str(EXAMPLES / "qwen3-32b-push-efa.yaml"))
    assert (code, err) == (0, "")
    assert out.startswith("---\n")
    expected = render_pdservice(
        parse_pdservice(yaml.safe_load((EXAMPLES / "qwen3-32b-push-efa.yaml").read_text())), RenderDefaults()
    )
    assert list(yaml.safe_load_all(out)) == expected


def test_render_reads_several_pdservices_from_stdin():
    text = (
        (EXAMPLES / "tiny-cpu.yaml").read_text()
        + "\n---\n"
        + (EXAMPLES / "nemotron-nano-hybrid.yaml").read_text()
    )
    code, out, _ = pdctl("render", "-f", "-", stdin=text)
    assert code == 0
    names = [doc["metadata"]["name"] for doc in yaml.safe_load_all(out) if doc["kind"] == "StatefulSet"]
    assert names == ["tiny-prefill", "tiny-decode", "nemotron-nano-prefill", "nemotron-nano-decode"]


def test_render_writes_one_file_per_object_into_the_output_dir(tmp_path):
    code, out, _ = pdctl(
        "render", "-f", str(EXAMPLES / "tiny-cpu.yaml"), "--output-dir", str(tmp_path / "out")
    )
    assert code == 0
    files = sorted((tmp_path / "out").iterdir())
    assert len(files) == 12
    assert sorted(out.splitlines()) == sorted(f"wrote {path}" for path in files)
    statefulset = yaml.safe_load((tmp_path / "out" / "statefulset-tiny-decode.yaml").read_text())
    assert statefulset["spec"]["serviceName"] == "tiny-decode"
    assert (tmp_path / "out" / "networkpolicy-tiny-router.yaml").exists()
    assert (tmp_path / "out" / "service-tiny-router.yaml").exists()


def test_an_invalid_spec_is_reported_by_field_path_with_exit_1(tmp_path):
    doc = yaml.safe_load((EXAMPLES / "nemotron-nano-hybrid.yaml").read_text())
    doc["spec"]["prefill"]["tensorParallelSize"] = "two"
    del doc["spec"]["ssm"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    code, out, err = pdctl("render", "-f", str(path))
    assert (code, out) == (1, "")
    assert f"{path}: spec.prefill.tensorParallelSize:" in err
    assert "Traceback" not in err


def test_every_error_of_every_document_is_reported(tmp_path):
    path = tmp_path / "two.yaml"
    pdservice = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    pdservice["spec"]["mode"] = "sideways"
    path.write_text("kind: Secret\napiVersion: v1\nmetadata: {name: s}\n---\n" + yaml.safe_dump(pdservice))
    code, out, err = pdctl("render", "-f", str(path))
    assert (code, out) == (1, "")
    assert f"{path}: document 1: kind:" in err
    assert f"{path}: document 2: spec.mode:" in err


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("spec: [", "yaml"),
        ("", "no PDService documents"),
        ("just a string", "must be a mapping"),
        (b"\xff\xfe\x00garbage", "not UTF-8"),
    ],
)
def test_unusable_files_fail_with_exit_1_and_a_message(tmp_path, content, fragment):
    path = tmp_path / "input.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, out, err = pdctl("render", "-f", str(path))
    assert (code, out) == (1, "")
    assert fragment in err


def test_a_missing_file_exits_2(tmp_path):
    code, _, err = pdctl("render", "-f", str(tmp_path / "absent.yaml"))
    assert code == 2
    assert "cannot read" in err


def test_an_unwritable_output_dir_exits_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = pdctl(
        "render", "-f", str(EXAMPLES / "tiny-cpu.yaml"), "--output-dir", str(blocker / "sub")
    )
    assert code == 2
    assert "cannot write" in err


yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)
spec_keys = st.sampled_from(
    [
        "mode",
        "model",
        "ssm",
        "prefill",
        "decode",
        "engine",
        "network",
        "router",
        "replicas",
        "tensorParallelSize",
        "name",
    ]
)
near_pdservices = st.fixed_dictionaries(
    {
        "apiVersion": st.sampled_from(["inference.pdoperator.dev/v1alpha1", "v1", 3]),
        "kind": st.sampled_from(["PDService", "Pod"]),
        "metadata": st.fixed_dictionaries({"name": st.sampled_from(["x", "", "UPPER", 5])}),
        "spec": st.dictionaries(spec_keys, yaml_values, max_size=6),
    }
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=near_pdservices | yaml_values)
def test_no_document_makes_render_crash(tmp_path, document):
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(document))
    code, _, err = pdctl("render", "-f", str(path))
    assert code in (0, 1)
    assert "Traceback" not in err
    if code == 1:
        assert err.strip()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_no_bytes_make_render_crash(tmp_path, raw):
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(raw)
    code, _, err = pdctl("render", "-f", str(path))
    assert code in (0, 1)
    assert "Traceback" not in err
