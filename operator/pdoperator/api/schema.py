"""The CRD's structural OpenAPI v3 schema, generated from the pydantic models.

pydantic writes JSON Schema with ``$defs``/``$ref`` and ``anyOf: [X, null]`` for
optional fields; Kubernetes wants a *structural* schema: every node inlined and
typed, optional fields simply not required (the API server prunes nulls), maps
as ``additionalProperties``, free-form objects as
``x-kubernetes-preserve-unknown-fields``. This module converts one into the other
and attaches the CEL rules of ``pdoperator.api.rules`` to the nodes of their
owner model. Anything the conversion does not understand is an error here, not a
surprise at ``kubectl apply``.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, NoDefault

from pdoperator.api.model import PDServiceSpec
from pdoperator.api.rules import CEL_RULES
from pdoperator.api.status import PDServiceStatus

# Child names like <name>-prefill are DNS-1035 labels (Service names) and the
# StatefulSet revision label <name>-prefill-<10-char hash> must fit in 63 characters.
MAX_NAME_LENGTH = 44
DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

# Keys of a pydantic node that carry over unchanged into the structural schema.
_KEPT_KEYWORDS = (
    "description",
    "type",
    "format",
    "enum",
    "default",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
)
# pydantic keywords with no meaning for Kubernetes, dropped on purpose.
_DROPPED_KEYWORDS = ("title", "$defs")


class SchemaError(ValueError):
    """The models produced JSON Schema this converter cannot make structural."""


class _Generator(GenerateJsonSchema):
    """pydantic's generator, plus defaults of nested objects and no ``default: null``.

    The API server only defaults a nested field when its parent object exists, so
    an object field defaulted by a model factory gets a default object. That object
    is written out whole (every defaulted field below it, not ``{}``): the API server
    checks each default against the schema and its CEL rules as written, without
    applying the nested defaults first, so a rule reading a nested defaulted field
    would fail on ``{}`` at CRD creation. Empty list/map factories get no default:
    absent and empty mean the same thing and the schema stays quiet.
    """

    def get_default_value(self, schema: Any) -> Any:
        if "default_factory" in schema:
            value = schema["default_factory"]()
            if isinstance(value, BaseModel):
                return default_object(value)
            return NoDefault
        default = super().get_default_value(schema)
        return NoDefault if default is None else default


def default_object(model: BaseModel) -> dict[str, Any]:
    """``model`` as a schema default: every field with a value, nested models whole, empty lists and maps left
    out (absent and empty mean the same, and a field given without them gets none either)."""
    dumped = model.model_dump(mode="json", by_alias=True, exclude_none=True)
    for name, field in type(model).model_fields.items():
        key = field.alias or name
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            dumped[key] = default_object(value)
        elif isinstance(value, list | dict) and not value:
            dumped.pop(key, None)
    return dumped


def _resolve(node: dict[str, Any], defs: dict[str, Any], where: str) -> tuple[dict[str, Any], str | None]:
    """The node with optional-``anyOf``, single ``allOf`` and ``$ref`` folded in, and the referenced model's
    name."""
    node = {key: value for key, value in node.items() if key not in _DROPPED_KEYWORDS}
    if "anyOf" in node:
        alternatives = [alt for alt in node.pop("anyOf") if alt != {"type": "null"}]
        if len(alternatives) != 1:
            raise SchemaError(
                f"{where}: a union of {len(alternatives)} types cannot be expressed in a structural schema"
            )
        node = {**alternatives[0], **node}
    if "allOf" in node:
        parts = node.pop("allOf")
        if len(parts) != 1:
            raise SchemaError(
                f"{where}: allOf with {len(parts)} parts cannot be expressed in a structural schema"
            )
        node = {**parts[0], **node}
    ref_name = None
    if "$ref" in node:
        ref_name = node.pop("$ref").removeprefix("#/$defs/")
        referenced = {key: value for key, value in defs[ref_name].items() if key not in _DROPPED_KEYWORDS}
        # The field's own description and default win over the referenced type's.
        node = {**referenced, **node}
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        # JSON Schema 2020 puts the bound in exclusiveMinimum; OpenAPI v3.0 (the CRD's dialect) flags minimum.
        if exclusive in node and not isinstance(node[exclusive], bool):
            node[bound] = node.pop(exclusive)
            node[exclusive] = True
    if node.get("additionalProperties") is True:
        node.pop("additionalProperties")
        node["x-kubernetes-preserve-unknown-fields"] = True
    if node.get("additionalProperties") is False:
        # Kubernetes prunes (or, with strict field validation, rejects) unknown fields by itself.
        node.pop("additionalProperties")
    return node, ref_name


def _structural(node: dict[str, Any], defs: dict[str, Any], where: str) -> dict[str, Any]:
    """The structural form of one pydantic schema node and its children, with the CEL rules of its model."""
    node, ref_name = _resolve(node, defs, where)
    out = {keyword: node.pop(keyword) for keyword in _KEPT_KEYWORDS if keyword in node}
    if "properties" in node:
        out["properties"] = {
            name: _structural(child, defs, f"{where}.{name}")
            for name, child in node.pop("properties").items()
        }
        if required := node.pop("required", []):
            out["required"] = required
    for keyword in ("items", "additionalProperties"):
        if keyword in node:
            out[keyword] = _structural(node.pop(keyword), defs, f"{where}[*]")
    if node:
        raise SchemaError(f"{where}: unsupported JSON Schema keywords {sorted(node)}")
    if "type" not in out:
        raise SchemaError(f"{where}: no type (structural schemas type every node)")
    if "description" not in out:
        raise SchemaError(f"{where}: no description (kubectl explain shows it to users)")
    if validations := [rule.validation() for rule in CEL_RULES if rule.owner.__name__ == ref_name]:
        out["x-kubernetes-validations"] = validations
    return out


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural schema of one model, as it appears under ``spec`` or ``status``."""
    generated = model.model_json_schema(by_alias=True, mode="validation", schema_generator=_Generator)
    defs = generated.pop("$defs", {})
    defs[model.__name__] = generated
    return _structural({"$ref": f"#/$defs/{model.__name__}"}, defs, model.__name__)


def openapi_schema() -> dict[str, Any]:
    """The CRD version's ``openAPIV3Schema``: the whole PDService object."""
    spec = model_schema(PDServiceSpec)
    status = model_schema(PDServiceStatus)
    schema = {
        "type": "object",
        "description": (
            "PDService runs one model as a prefill/decode disaggregated vLLM service: prefill and decode "
            "engine "
            "StatefulSets exchanging KV cache over NIXL, and an OpenAI-compatible router in front."
        ),
        "required": ["spec"],
        "properties": {
            "apiVersion": {
                "type": "string",
                "description": "Versioned schema of this object: inference.pdoperator.dev/v1alpha1.",
            },
            "kind": {"type": "string", "description": "PDService."},
            # The API server owns metadata's schema: it refuses a CRD whose root metadata node says anything
            # but restrictions of name and generateName (a description included).
            "metadata": {
                "type": "object",
                "properties": {
                    "name": {
                        "type": "string",
                        "description": (
                            f"Name of the service: a DNS-1035 label of at most {MAX_NAME_LENGTH} characters, "
                            "so the child objects <name>-prefill, <name>-decode and <name>-router are valid "
                            "names."
                        ),
                        "maxLength": MAX_NAME_LENGTH,
                        "pattern": DNS_1035_LABEL,
                    }
                },
            },
            "spec": spec,
            "status": status,
        },
    }
    # pydantic shares sub-objects between nodes; a plain tree keeps the YAML free of anchors.
    return json.loads(json.dumps(schema))


def schema_nodes(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every node of a structural schema with its path (``.spec.prefill``, ``.spec.prefill.env[*]``)."""
    nodes = [(path, schema)]
    for name, child in schema.get("properties", {}).items():
        nodes.extend(schema_nodes(child, f"{path}.{name}"))
    for keyword in ("items", "additionalProperties"):
        if isinstance(schema.get(keyword), dict):
            nodes.extend(schema_nodes(schema[keyword], f"{path}[*]"))
    return nodes


def node_at(schema: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The schema node at a dotted path like ``.spec.model.name`` (``[*]`` steps into items), or None."""
    for node_path, node in schema_nodes(schema):
        if node_path == path:
            return copy.deepcopy(node)
    return None
