"""LeaderWorkerSets checked against the pinned LeaderWorkerSet CRD's schema (``tests/k8s/lws``), as the API
server with ``kubectl --validate=strict`` would: types, required fields, enums, and unknown fields refused
wherever the schema lists an object's fields (a structural schema prunes them silently otherwise)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRD_PATH = Path(__file__).parent / "lws" / "leaderworkersets.leaderworkerset.x-k8s.io.yaml"
VERSION = "v1"


def _strict(node: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object node that lists its properties and
    keeps no unknown fields; Kubernetes' int-or-string as JSON Schema's either-or."""
    if isinstance(node, list):
        return [_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    strict = {key: _strict(value) for key, value in node.items()}
    if strict.get("x-kubernetes-int-or-string"):
        strict.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if (
        "properties" in strict
        and "additionalProperties" not in strict
        and not strict.get("x-kubernetes-preserve-unknown-fields")
    ):
        strict["additionalProperties"] = False
    return strict


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    crd = yaml.load(CRD_PATH.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = (v for v in crd["spec"]["versions"] if v["name"] == VERSION)
    schema = _strict(version["schema"]["openAPIV3Schema"])
    # apiVersion, kind and metadata are the API server's to check; the CRD types them loosely.
    return jsonschema.Draft7Validator(schema)


def leader_worker_set_errors(obj: dict[str, Any]) -> list[str]:
    """The schema errors of one LeaderWorkerSet (``/spec/leaderWorkerTemplate/size: '2' is not of type
    'integer'``); empty when valid."""
    errors = sorted(_validator().iter_errors(obj), key=lambda error: list(error.absolute_path))
    return [f"/{'/'.join(str(part) for part in error.absolute_path)}: {error.message}" for error in errors]
