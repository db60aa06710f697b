"""From a Kubernetes object (a dict) to a validated ``PDService``, or a ``SpecError`` listing every problem.

The spec goes through pydantic in strict JSON mode, which accepts what the API
server accepts (``"8"`` is not an integer, ``yes`` in quotes is not a boolean);
null fields are dropped first, as the API server prunes them. pydantic's errors
are rewritten into Kubernetes-style field paths and plain sentences.
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from pdoperator.api.base import DNS_SUBDOMAIN, ENV_VAR_NAME, QUANTITY, SECRET_KEY
from pdoperator.api.errors import FieldError, SpecError, path_key, type_name
from pdoperator.api.model import API_VERSION, ENGINE_ID, KIND, RELATIVE_PATH, PDService, PDServiceSpec
from pdoperator.api.validation import spec_errors, validate_metadata

TOP_LEVEL_FIELDS = ("apiVersion", "kind", "metadata", "spec", "status")

_PATTERN_MEANINGS = {
    DNS_SUBDOMAIN: "must be a DNS subdomain: lowercase letters, digits, '-' and '.', starting and ending "
    "alphanumeric",
    QUANTITY: "must be a Kubernetes quantity such as 16Gi, 500m or 2",
    ENV_VAR_NAME: "must be an environment variable name: letters, digits, '_', '-' and '.', not starting "
    "with a digit",
    SECRET_KEY: "must be a Secret key: letters, digits, '-', '_' and '.'",
    RELATIVE_PATH: "must be a path relative to the volume root (no leading '/')",
    ENGINE_ID: "must start with a letter or digit and contain only letters, digits, '-', '_' and '.'",
}


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _unwrap(annotation: Any) -> Any:
    """Strip ``Annotated`` and ``X | None`` down to the type that holds the value."""
    while True:
        if typing.get_origin(annotation) is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif typing.get_origin(annotation) in (typing.Union, types.UnionType):
            members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
            if len(members) != 1:
                return annotation
            annotation = members[0]
        else:
            return annotation


def _field_by_alias(model: type[BaseModel], key: str) -> Any:
    for name, field in model.model_fields.items():
        if key in (field.alias, name):
            return field.annotation
    return None


def _locate(loc: tuple[int | str, ...]) -> tuple[str, type[BaseModel] | None]:
    """The field path of a pydantic error location under ``spec``, and the model holding its last step."""
    path = "spec"
    current: Any = PDServiceSpec
    parent: type[BaseModel] | None = None
    for step in loc:
        current = _unwrap(current)
        origin = typing.get_origin(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            parent = current
            path += f".{path_key(str(step))}"
            current = _field_by_alias(current, str(step))
        elif origin is list:
            path += f"[{step}]"
            current = typing.get_args(current)[0]
            parent = None
        elif origin is dict:
            path += f"[{path_key(str(step))}]"
            current = typing.get_args(current)[1]
            parent = None
        else:
            path += f"[{step}]" if isinstance(step, int) else f".{path_key(step)}"
            current = None
            parent = None
    return path, parent


def _not_string(ctx: dict[str, Any], value: Any) -> str:
    hint = (
        "; quote values like 1 or 500m in YAML"
        if isinstance(value, int | float) and not isinstance(value, bool)
        else ""
    )
    return f"must be a string{_got(value)}{hint}"


def _got(value: Any) -> str:
    return f" (got {_show(value)})"


# pydantic error type -> sentence, given the error's context and the offending value.
_MESSAGES: dict[str, Callable[[dict[str, Any], Any], str]] = {
    "missing": lambda ctx, value: "required",
    # pydantic re-parses the spec as JSON, with a nesting limit of its own.
    "json_invalid": lambda ctx, value: (
        "is nested too deeply" if "recursion" in str(ctx.get("error")) else "is not valid JSON"
    ),
    "enum": lambda ctx, value: f"must be {ctx['expected']}{_got(value)}",
    "literal_error": lambda ctx, value: f"must be {ctx['expected']}{_got(value)}",
    "int_type": lambda ctx, value: f"must be an integer{_got(value)}",
    "int_parsing": lambda ctx, value: f"must be an integer{_got(value)}",
    "int_from_float": lambda ctx, value: f"must be an integer{_got(value)}",
    "int_parsing_size": lambda ctx, value: "is too large",
    "bool_type": lambda ctx, value: f"must be true or false{_got(value)}",
    "bool_parsing": lambda ctx, value: f"must be true or false{_got(value)}",
    "string_type": _not_string,
    "model_type": lambda ctx, value: f"must be an object{_got(value)}",
    "dict_type": lambda ctx, value: f"must be an object{_got(value)}",
    "model_attributes_type": lambda ctx, value: f"must be an object{_got(value)}",
    "list_type": lambda ctx, value: f"must be a list{_got(value)}",
    "greater_than_equal": lambda ctx, value: f"must be at least {ctx['ge']}{_got(value)}",
    "less_than_equal": lambda ctx, value: f"must be at most {ctx['le']}{_got(value)}",
    "string_too_short": lambda ctx, value: (
        "must not be empty"
        if ctx["min_length"] == 1
        else f"must be at least {ctx['min_length']} characters long"
    ),
    "string_too_long": lambda ctx, value: f"must be at most {ctx['max_length']} characters long",
    "too_long": lambda ctx, value: f"must have at most {ctx['max_length']} items",
    "string_pattern_mismatch": lambda ctx, value: (
        _PATTERN_MEANINGS.get(ctx["pattern"], f"must match {ctx['pattern']}") + _got(value)
    ),
}


def _message(error: ErrorDetails, parent: type[BaseModel] | None) -> str:
    if error["type"] == "extra_forbidden":
        known = [field.alias or name for name, field in parent.model_fields.items()] if parent else []
        close = difflib.get_close_matches(str(error["loc"][-1]), known, n=1)
        return "unknown field" + (f" (did you mean {close[0]}?)" if close else "")
    describe = _MESSAGES.get(error["type"])
    return describe(error.get("ctx", {}), error.get("input")) if describe else error["msg"]


def spec_field_errors(error: ValidationError) -> list[FieldError]:
    """pydantic's errors for a ``PDServiceSpec`` as FieldErrors with Kubernetes field paths."""
    field_errors = []
    for detail in error.errors(include_url=False):
        path, parent = _locate(detail["loc"])
        field_errors.append(FieldError(path, _message(detail, parent)))
    return field_errors


def _drop_nulls(value: Any) -> Any:
    """The API server prunes null fields that are not nullable (none of ours are) before validating."""
    if isinstance(value, dict):
        return {key: _drop_nulls(child) for key, child in value.items() if child is not None}
    if isinstance(value, list):
        return [_drop_nulls(item) for item in value]
    return value


def _jsonable(value: Any) -> Any:
    """What json cannot encode itself: mapping views (kopf bodies) as dicts, anything else (dates) as text."""
    return dict(value) if isinstance(value, Mapping) else str(value)


def _as_json(obj: Any) -> dict[str, Any]:
    """A JSON-clean copy of the object (keys as strings, dates as text); SpecError when impossible."""
    if not isinstance(obj, Mapping):
        raise SpecError(
            [FieldError("document", f"must be a mapping (a Kubernetes object), got {type_name(obj)}")]
        )
    try:
        return json.loads(json.dumps(dict(obj), default=_jsonable))
    except (TypeError, ValueError) as error:
        raise SpecError([FieldError("document", f"is not representable as JSON: {error}")]) from None
    except RecursionError:
        raise SpecError([FieldError("document", "nested too deeply")]) from None


def _metadata(obj: dict[str, Any], errors: list[FieldError]) -> tuple[str, str, int, str]:
    """name, namespace, generation and uid from metadata, recording what is wrong with them."""
    metadata = obj.get("metadata")
    if not isinstance(metadata, dict):
        errors.append(
            FieldError(
                "metadata", "required" if metadata is None else f"must be an object (got {_show(metadata)})"
            )
        )
        return "", "default", 1, ""
    name, namespace = metadata.get("name"), metadata.get("namespace") or "default"
    generation, uid = metadata.get("generation", 1), metadata.get("uid", "")
    if not name:
        errors.append(FieldError("metadata.name", "required"))
    elif not isinstance(name, str):
        errors.append(FieldError("metadata.name", f"must be a string (got {_show(name)})"))
    if not isinstance(namespace, str):
        errors.append(FieldError("metadata.namespace", f"must be a string (got {_show(namespace)})"))
    if isinstance(name, str) and name and isinstance(namespace, str):
        errors.extend(validate_metadata(name, namespace))
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        errors.append(
            FieldError("metadata.generation", f"must be a non-negative integer (got {_show(generation)})")
        )
    if not isinstance(uid, str):
        errors.append(FieldError("metadata.uid", f"must be a string (got {_show(uid)})"))
    return str(name or ""), str(namespace), generation if isinstance(generation, int) else 1, str(uid)


def parse_pdservice(obj: Any) -> PDService:
    """Parse and validate a PDService object (as read from YAML or the API); SpecError lists every problem."""
    plain = _as_json(obj)
    errors: list[FieldError] = []
    for key, expected in (("apiVersion", API_VERSION), ("kind", KIND)):
        value = plain.get(key)
        if value != expected:
            errors.append(
                FieldError(key, f"must be {expected}" + ("" if value is None else f" (got {_show(value)})"))
            )
    errors += [FieldError(path_key(key), "unknown field") for key in plain if key not in TOP_LEVEL_FIELDS]
    name, namespace, generation, uid = _metadata(plain, errors)

    spec: PDServiceSpec | None = None
    raw_spec = plain.get("spec")
    if not isinstance(raw_spec, dict):
        errors.append(
            FieldError(
                "spec", "required" if raw_spec is None else f"must be an object (got {_show(raw_spec)})"
            )
        )
    else:
        try:
            spec = PDServiceSpec.model_validate_json(json.dumps(_drop_nulls(raw_spec)), strict=True)
        except ValidationError as error:
            errors += spec_field_errors(error)
    if spec is not None:
        errors += spec_errors(spec)
    if errors or spec is None:
        raise SpecError(errors)
    return PDService(name=name, namespace=namespace, spec=spec, generation=generation, uid=uid)
