"""Every example is a valid PDService for pdctl, for the CRD's schema and for its CEL rules."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pdoperator.api import Architecture, TransferMode, TransportBackend, load_documents, parse_pdservice

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples").glob("*.yaml"))

EXPECTED_EXAMPLES = {"qwen3-32b-push-efa.yaml", "nemotron-nano-hybrid.yaml", "tiny-cpu.yaml"}


def schema_errors(openapi: dict[str, Any], document: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(openapi)
    return sorted(
        f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
        for error in validator.iter_errors(document)
    )


def test_the_published_examples_exist():
    assert {path.name for path in EXAMPLES} >= EXPECTED_EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_example_parses_and_validates(path):
    (document,) = load_documents(path)
    parsed = parse_pdservice(document)
    assert parsed.name == document["metadata"]["name"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_example_passes_the_crd_schema_and_its_cel_rules(path, openapi, spec_cel_violations):
    (document,) = load_documents(path)
    assert schema_errors(openapi, document) == []
    assert spec_cel_violations(document["spec"]) == set()


def test_examples_say_what_they_claim(example_documents):
    parsed = {name: parse_pdservice(document).spec for name, document in example_documents}
    qwen = parsed["qwen3-32b-push-efa.yaml"]
    assert (qwen.mode, qwen.engine.transport.backend, qwen.network.efa.enabled) == (
        TransferMode.PUSH,
        TransportBackend.LIBFABRIC,
        True,
    )
    assert (
        qwen.prefill.tensor_parallel_size,
        qwen.decode.tensor_parallel_size,
        qwen.network.efa.prefill_devices,
    ) == (8, 8, 16)
    hybrid = parsed["nemotron-nano-hybrid.yaml"]
    assert hybrid.model.architecture is Architecture.HYBRID_SSM
    assert hybrid.prefill.tensor_parallel_size != hybrid.decode.tensor_parallel_size
    tiny = parsed["tiny-cpu.yaml"]
    assert (tiny.engine.transport.backend, tiny.prefill.resources.gpus, tiny.decode.resources.gpus) == (
        TransportBackend.MOCK,
        0,
        0,
    )


def _tiny() -> dict[str, Any]:
    (document,) = load_documents(next(path for path in EXAMPLES if path.name == "tiny-cpu.yaml"))
    return copy.deepcopy(document)


def _set(document: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    *parents, last = path.split(".")
    node = document
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return document


SCHEMA_REJECTS = [
    ("spec.mode", "both", "'both' is not one of ['push', 'pull']"),
    ("spec.prefill.tensorParallelSize", 0, "0 is less than the minimum of 1"),
    ("spec.decode.tensorParallelSize", "2", "'2' is not of type 'integer'"),
    ("spec.decode.replicas", 2000, "2000 is greater than the maximum of 1024"),
    ("spec.engine.transport.backend", "tcp", "'tcp' is not one of ['LIBFABRIC', 'UCX', 'mock']"),
    ("spec.model.name", "", "'' should be non-empty"),
    ("spec.prefill.resources.memory", "lots", "'lots' does not match"),
    ("spec.prefill.nodeSelector", {"zone": 3}, "3 is not of type 'string'"),
    ("spec.prefill.env", [{"value": "x"}], "'name' is a required property"),
    ("spec.router.apiKeySecretRef", {"name": "Bad Name", "key": "k"}, "'Bad Name' does not match"),
    ("spec.ssm", {"convStateLayout": "XY"}, "'XY' is not one of ['DS', 'SD']"),
    ("metadata.name", "x" * 45, "is too long"),
    ("spec.prefill.extraArgs", "--enforce-eager", "'--enforce-eager' is not of type 'array'"),
]


@pytest.mark.parametrize(
    ("path", "value", "expected"), SCHEMA_REJECTS, ids=[case[0] for case in SCHEMA_REJECTS]
)
def test_the_schema_rejects_a_bad_value(path, value, expected, openapi):
    errors = schema_errors(openapi, _set(_tiny(), path, value))
    assert errors, f"{path}={value!r} passed the schema"
    assert any(expected in error for error in errors), errors


def test_the_schema_requires_a_spec_and_a_model(openapi):
    document = _tiny()
    del document["spec"]["model"]
    assert schema_errors(openapi, document) == ["spec: 'model' is a required property"]
    del document["spec"]
    assert schema_errors(openapi, document) == [": 'spec' is a required property"]
