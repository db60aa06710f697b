"""parse_pdservice: what it accepts like the API server, what it carries over, and that it never crashes."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pdoperator.api import (
    API_VERSION,
    FieldError,
    ModelSpec,
    PDServiceSpec,
    SpecError,
    TransferMode,
    load_documents,
    parse_pdservice,
    validate_spec,
)
from pdoperator.api.parse import _drop_nulls
from pdoperator.api.schema import openapi_schema, schema_nodes

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples").glob("*.yaml"))


def pdservice(spec: Any, **metadata: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "PDService",
        "metadata": {"name": "svc", **metadata},
        "spec": spec,
    }


def test_field_error_reads_as_path_and_message():
    error = FieldError("spec.ssm", "required")
    assert str(error) == "spec.ssm: required"
    with pytest.raises(dataclasses.FrozenInstanceError):
        error.path = "x"  # type: ignore[misc]


def test_spec_error_carries_every_error_and_prints_one_per_line():
    error = SpecError([FieldError("a", "x"), FieldError("b", "y")])
    assert error.errors == [FieldError("a", "x"), FieldError("b", "y")]
    assert str(error) == "a: x\nb: y"
    with pytest.raises(ValueError, match="at least one"):
        SpecError([])


def test_namespace_defaults_and_metadata_is_carried_over():
    parsed = parse_pdservice(pdservice({"model": {"name": "m"}}))
    assert (parsed.name, parsed.namespace, parsed.generation, parsed.uid) == ("svc", "default", 1, "")
    parsed = parse_pdservice(pdservice({"model": {"name": "m"}}, namespace="ml", generation=7, uid="abc"))
    assert (parsed.namespace, parsed.generation, parsed.uid) == ("ml", 7, "abc")


def test_nulls_are_pruned_like_the_api_server_does():
    parsed = parse_pdservice(
        pdservice({"model": {"name": "m", "servedName": None}, "mode": None, "ssm": None, "decode": None})
    )
    assert parsed.spec.mode is TransferMode.PUSH
    assert parsed.spec.ssm is None
    assert parsed.spec.model.served_name is None
    assert parsed.spec.decode.tensor_parallel_size == 1


def test_read_only_mapping_views_are_accepted():
    """The operator may hand over a body view (kopf) rather than a dict."""
    document = pdservice({"model": {"name": "m"}, "prefill": MappingProxyType({"tensorParallelSize": 1})})
    assert parse_pdservice(MappingProxyType(document)).spec.prefill.tensor_parallel_size == 1


def test_status_is_ignored():
    parsed = parse_pdservice(
        {**pdservice({"model": {"name": "m"}}), "status": {"phase": "Ready", "anything": 1}}
    )
    assert parsed.name == "svc"


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ([1, 2], "document: must be a mapping (a Kubernetes object), got a list"),
        ("text", "document: must be a mapping (a Kubernetes object), got a string"),
        (None, "document: must be a mapping (a Kubernetes object), got null"),
        (
            {("tuple", "key"): 1},
            "document: is not representable as JSON: keys must be str, int, float, bool or None, not tuple",
        ),
    ],
)
def test_objects_that_are_not_kubernetes_objects(obj, expected):
    with pytest.raises(SpecError) as caught:
        parse_pdservice(obj)
    assert [str(error) for error in caught.value.errors] == [expected]


def test_validate_spec_on_a_model_built_in_python():
    spec = PDServiceSpec(model=ModelSpec(name="m"))
    assert validate_spec(spec, "svc") == []
    assert [str(error) for error in validate_spec(spec, "svc", namespace="Bad")] == [
        "metadata.namespace: must be a DNS label: at most 63 lowercase letters, digits and '-', starting "
        "and ending alphanumeric"
    ]


# ------------------------------------------------------------------ fuzzing

# Every property name of the CRD's spec schema, so the fuzzer reaches every nested object.
_FIELD_NAMES = sorted(
    {
        path.rsplit(".", 1)[-1]
        for path, _ in schema_nodes(openapi_schema()["properties"]["spec"], "spec")
        if "[*]" not in path[-3:]
    }
)
_keys = st.sampled_from(_FIELD_NAMES) | st.text(max_size=6)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(
        [
            "push",
            "pull",
            "hybrid-ssm",
            "mamba1",
            "DS",
            "SD",
            "mock",
            "LIBFABRIC",
            "vllm",
            "Exists",
            "16Gi",
            "0",
            "--port",
        ]
    )
)
_json = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_keys, children, max_size=5),
    max_leaves=25,
)


def _assert_only_spec_errors(document: dict[str, Any], openapi: dict[str, Any]) -> None:
    try:
        parsed = parse_pdservice(document)
    except SpecError as error:
        assert error.errors
        for problem in error.errors:
            assert problem.path and problem.message and "\n" not in str(problem)
    else:
        # What pdctl accepts, the API server's schema accepts too.
        pruned = _drop_nulls(document)
        assert list(jsonschema.Draft4Validator(openapi).iter_errors(pruned)) == []
        assert parsed.name == "svc"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_json)
def test_random_json_under_spec_only_ever_raises_spec_error(spec, openapi):
    _assert_only_spec_errors(pdservice(spec), openapi)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _paths(child, (*prefix, index))
    return found


@st.composite
def _mutated_examples(draw: st.DrawFn) -> dict[str, Any]:
    (document,) = load_documents(draw(st.sampled_from(EXAMPLES)))
    spec = copy.deepcopy(document["spec"])
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(spec)[1:]))
        parent = spec
        for step in path[:-1]:
            parent = parent[step]
        parent[path[-1]] = draw(_json)
    return pdservice(spec)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(document=_mutated_examples())
def test_mutated_examples_only_ever_raise_spec_error(document, openapi):
    _assert_only_spec_errors(document, openapi)
