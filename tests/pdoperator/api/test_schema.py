"""The generated openAPIV3Schema is structural, documented, and agrees with the pydantic models."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from pdoperator.api import PDServiceSpec
from pdoperator.api.rules import CEL_RULES
from pdoperator.api.schema import SchemaError, _structural, schema_nodes

from .conftest import cel_violations

FORBIDDEN_KEYWORDS = ("$ref", "$defs", "anyOf", "allOf", "oneOf", "not", "title", "nullable")


def _all_dicts(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, dict):
        return [value, *(found for child in value.values() for found in _all_dicts(child))]
    if isinstance(value, list):
        return [found for child in value for found in _all_dicts(child)]
    return []


def test_schema_uses_no_composition_or_references_anywhere(openapi):
    for node in _all_dicts(openapi):
        assert not set(FORBIDDEN_KEYWORDS) & set(node), node


def test_every_node_has_a_type_and_a_description(openapi):
    for path, node in schema_nodes(openapi):
        assert node.get("type") in ("object", "array", "string", "integer", "boolean"), path
        if path != ".metadata":
            assert len(node.get("description", "")) >= 5, f"{path or '<root>'} has no useful description"


def test_root_metadata_restricts_only_name_and_generate_name_as_the_api_server_demands(openapi):
    """kube-apiserver refuses a CRD whose root metadata node says anything else, a description included."""
    metadata = openapi["properties"]["metadata"]
    assert set(metadata) <= {"type", "properties"}
    assert set(metadata["properties"]) <= {"name", "generateName"}


def test_objects_have_either_properties_or_a_map_value_schema(openapi):
    for path, node in schema_nodes(openapi):
        assert not ("properties" in node and "additionalProperties" in node), path
        if node.get("type") == "array":
            assert isinstance(node.get("items"), dict), path
        for name in node.get("required", []):
            assert name in node["properties"], f"{path}: required {name} is not a property"


def test_metadata_only_restricts_the_name(openapi):
    metadata = openapi["properties"]["metadata"]
    assert metadata["type"] == "object"
    assert set(metadata["properties"]) == {"name"}


def test_free_form_affinity_is_preserved_and_maps_use_additional_properties(openapi):
    role = openapi["properties"]["spec"]["properties"]["prefill"]
    assert role["properties"]["affinity"] == {
        "description": role["properties"]["affinity"]["description"],
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
    }
    assert role["properties"]["nodeSelector"]["additionalProperties"]["type"] == "string"
    assert role["properties"]["env"]["x-kubernetes-list-map-keys"] == ["name"]


def test_kubectl_explain_spec_ssm_is_useful(openapi):
    ssm = openapi["properties"]["spec"]["properties"]["ssm"]
    assert "hybrid" in ssm["description"]
    assert ssm["properties"]["family"]["enum"] == ["mamba2", "mamba1", "gdn"]
    assert ssm["properties"]["convStateLayout"] == {
        "description": ssm["properties"]["convStateLayout"]["description"],
        "type": "string",
        "enum": ["DS", "SD"],
        "default": "DS",
    }
    assert "VLLM_SSM_CONV_STATE_LAYOUT" in ssm["properties"]["convStateLayout"]["description"]
    assert ssm["required"] == ["family"]


def test_bounds_and_enums_come_from_the_model(openapi):
    spec = openapi["properties"]["spec"]["properties"]
    tp = spec["prefill"]["properties"]["tensorParallelSize"]
    assert (tp["minimum"], tp["maximum"], tp["default"]) == (1, 64, 1)
    assert spec["mode"]["enum"] == ["push", "pull"]
    assert spec["mode"]["default"] == "push"
    assert spec["engine"]["properties"]["transport"]["properties"]["backend"]["enum"] == [
        "LIBFABRIC",
        "UCX",
        "mock",
    ]
    assert openapi["properties"]["spec"]["required"] == ["model"]


def test_nested_objects_default_to_their_whole_defaulted_content(openapi, defaulted):
    """A default is written out whole, equal to what nested defaulting would give: the API server checks
    defaults as written, without applying the defaults below them (``{}`` failed every rule reading a nested
    default at CRD creation), and stores the same spec whether the object was omitted or given empty."""
    spec = openapi["properties"]["spec"]["properties"]
    for name in ("prefill", "decode", "engine", "network", "router"):
        assert spec[name]["default"], name
        assert spec[name]["default"] == defaulted(spec[name], {}), name
    assert spec["engine"]["default"]["transport"]["backend"] == "UCX"
    assert spec["model"]["properties"]["source"]["default"] == {"huggingFace": {}}
    # Optional fields have no default at all (the API server would otherwise store nulls).
    assert "default" not in spec["ssm"]


def test_every_cel_rule_holds_on_every_default_as_written(openapi):
    """What kube-apiserver checks when the CRD is created (it does not default a default)."""
    for path, node in schema_nodes(openapi):
        if "default" in node:
            assert not cel_violations(node, node["default"], path), path


def test_every_default_is_valid_under_its_own_schema(openapi, defaulted):
    for path, node in schema_nodes(openapi):
        if "default" in node:
            problems = [
                error.message
                for error in jsonschema.Draft4Validator(node).iter_errors(defaulted(node, node["default"]))
            ]
            assert not problems, f"{path}: {problems}"


@pytest.mark.parametrize("rule", CEL_RULES, ids=lambda rule: rule.name)
def test_every_rule_is_attached_and_its_field_path_exists(rule, openapi):
    owners = [
        (path, node)
        for path, node in schema_nodes(openapi)
        if rule.validation() in node.get("x-kubernetes-validations", [])
    ]
    assert owners, f"{rule.name} is attached nowhere"
    for path, _ in owners:
        if rule.field_path:
            assert path + rule.field_path in {node_path for node_path, _ in schema_nodes(openapi)}, (
                path + rule.field_path
            )


def test_schema_defaults_match_the_model_defaults(openapi, defaulted, example_documents):
    """What the API server stores after defaulting is what the operator's model reads."""
    spec_schema = openapi["properties"]["spec"]
    for name, document in example_documents:
        by_schema = _drop_empty(defaulted(spec_schema, document["spec"]))
        by_model = _drop_empty(
            PDServiceSpec.model_validate(document["spec"]).model_dump(
                mode="json", by_alias=True, exclude_none=True
            )
        )
        assert by_schema == by_model, name


def _drop_empty(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _drop_empty(child) for key, child in value.items() if child not in ({}, [])}
    return value


def test_unions_the_api_server_cannot_express_are_refused():
    union = {"anyOf": [{"type": "string"}, {"type": "integer"}], "description": "either"}
    with pytest.raises(SchemaError, match="union of 2 types"):
        _structural(union, {}, "spec.x")


def test_undocumented_fields_are_refused():
    with pytest.raises(SchemaError, match="no description"):
        _structural({"type": "string"}, {}, "spec.x")
