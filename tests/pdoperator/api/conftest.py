"""Stand-ins for what the API server does with the CRD, built from the CRD itself.

``apply_defaults`` is the structural defaulting the API server applies before
validation; ``cel_violations`` evaluates every ``x-kubernetes-validations`` rule of
the schema on the defaulted object with a real CEL interpreter (cel-python), at
every node it is attached to, reporting ``(path, message)`` like the API server.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from pdoperator.api import crd_manifest

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

_CEL = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: absent fields with a default get it, top-down, then their children are
    defaulted."""
    if isinstance(value, dict) and schema.get("type") == "object":
        out = dict(value)
        for name, prop in schema.get("properties", {}).items():
            if name not in out and "default" in prop:
                out[name] = copy.deepcopy(prop["default"])
            if name in out:
                out[name] = apply_defaults(prop, out[name])
        if isinstance(schema.get("additionalProperties"), dict):
            out = {key: apply_defaults(schema["additionalProperties"], child) for key, child in out.items()}
        return out
    if isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def evaluate_cel(rule: str, self_value: Any) -> bool:
    """A rule's result on ``self``; fails the test if the rule errors (e.g. reads an absent field)."""
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _CEL.program(_CEL.compile(rule))
    result = _PROGRAMS[rule].evaluate({"self": celpy.json_to_cel(self_value)})
    assert isinstance(result, celpy.celtypes.BoolType), (
        f"CEL rule {rule!r} did not yield a bool on {self_value!r}: {result!r}"
    )
    return bool(result)


def cel_violations(schema: dict[str, Any], value: Any, path: str) -> set[tuple[str, str]]:
    """(error path, message) of every CEL rule the (defaulted) value breaks, at every node of the schema."""
    found = set()
    for validation in schema.get("x-kubernetes-validations", []):
        if not evaluate_cel(validation["rule"], value):
            found.add((path + validation.get("fieldPath", ""), validation["message"]))
    if isinstance(value, dict):
        for name, prop in schema.get("properties", {}).items():
            if name in value:
                found |= cel_violations(prop, value[name], f"{path}.{name}")
        if isinstance(schema.get("additionalProperties"), dict):
            for key, child in value.items():
                found |= cel_violations(schema["additionalProperties"], child, f"{path}[{key}]")
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            found |= cel_violations(schema["items"], item, f"{path}[{index}]")
    return found


@pytest.fixture(scope="session")
def openapi() -> dict[str, Any]:
    """The openAPIV3Schema of the CRD as the API server would receive it."""
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="session")
def spec_cel_violations(openapi: dict[str, Any]) -> Callable[[dict[str, Any]], set[tuple[str, str]]]:
    """What the API server's CEL rules reject in a spec (given as written by a user)."""
    spec_schema = openapi["properties"]["spec"]

    def violations(spec: dict[str, Any]) -> set[tuple[str, str]]:
        return cel_violations(spec_schema, apply_defaults(spec_schema, spec), "spec")

    return violations


@pytest.fixture(scope="session")
def defaulted() -> Callable[[dict[str, Any], dict[str, Any]], Any]:
    return apply_defaults


@pytest.fixture(scope="session")
def example_documents() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, yaml.safe_load(path.read_text())) for path in EXAMPLES]
