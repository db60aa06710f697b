"""What kube-apiserver checks before it touches storage, as pure functions for the emulator: request paths,
query parameters, object names and labels, selectors, patches, and the ``Status`` bodies of its errors.

The wording of messages and the shape of ``details`` follow what the real server answers (measured against
``pd-apiserver``, Kubernetes 1.36 code; ``tests/k8s/test_conformance.py`` compares them case by case), because
clients branch on ``code``/``reason`` and people read ``message``.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from typing import Any

import aiohttp.web
import kmock
import yaml
from kmock._internal import enums, rendering

# kube-apiserver's request body limit (--max-request-bytes default): larger bodies are answered 413.
MAX_BODY_BYTES = 3 * 1024 * 1024
STRATEGIC_MERGE = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
PATCH_TYPES = ("application/json-patch+json", "application/merge-patch+json", STRATEGIC_MERGE, APPLY_PATCH)
_FIELD_VALIDATION = ("", "Ignore", "Strict", "Warn")
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*"
_DNS1035_LABEL = r"[a-z]([-a-z0-9]*[a-z0-9])?"
_QUALIFIED_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"


class ApiError(Exception):
    """A failure answered with a Kubernetes ``Status`` object (``reason`` None: the real server sends none,
    as for its internal errors)."""

    def __init__(
        self, code: int, reason: str | None, message: str, details: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
        body["message"] = self.message
        if self.reason:
            body["reason"] = self.reason
        if self.details is not None:
            body["details"] = dict(self.details)
        body["code"] = self.code
        return body

    def response(self) -> aiohttp.web.Response:
        return aiohttp.web.json_response(self.body(), status=self.code)


def qualified(resource: kmock.resource) -> str:
    """``statefulsets.apps``, ``configmaps``: how the real server names a resource in its messages."""
    return f"{resource.plural}.{resource.group}" if resource.group else str(resource.plural)


def not_found(resource: kmock.resource, name: str) -> ApiError:
    details = {"name": name, "group": resource.group, "kind": resource.plural}
    return ApiError(404, "NotFound", f'{qualified(resource)} "{name}" not found', _drop_empty(details))


def already_exists(resource: kmock.resource, name: str) -> ApiError:
    details = {"name": name, "group": resource.group, "kind": resource.plural}
    return ApiError(
        409, "AlreadyExists", f'{qualified(resource)} "{name}" already exists', _drop_empty(details)
    )


def conflict(resource: kmock.resource, name: str) -> ApiError:
    message = (
        f'Operation cannot be fulfilled on {qualified(resource)} "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again"
    )
    details = {"name": name, "group": resource.group, "kind": resource.plural}
    return ApiError(409, "Conflict", message, _drop_empty(details))


def namespace_not_found(namespace: str) -> ApiError:
    """The NamespaceLifecycle admission plugin's answer to a create in a namespace that does not exist."""
    return ApiError(
        404, "NotFound", f'namespaces "{namespace}" not found', {"name": namespace, "kind": "namespaces"}
    )


def invalid(kind: str, group: str, name: str, causes: list[tuple[str, str, str]]) -> ApiError:
    """422 for field errors: ``causes`` are ``(reason, field, message)``."""
    what = f"{kind}.{group}" if group else kind
    text = ", ".join(f"{field}: {message}" for _, field, message in causes)
    text = f"[{text}]" if len(causes) > 1 else text
    details = {
        "name": name,
        "group": group,
        "kind": kind,
        "causes": [{"reason": r, "message": m, "field": f} for r, f, m in causes],
    }
    return ApiError(422, "Invalid", f'{what} "{name}" is invalid: {text}', _drop_empty(details))


def _drop_empty(details: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in details.items() if v not in ("", None)}


# ---------------------------------------------------------------- paths and query parameters


def parse_k8s_path(path: str) -> tuple[kmock.resource | None, str | None, str | None, str | None]:
    """``(resource, namespace, name, subresource)`` of an API path; resource None for discovery and other
    paths."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None, None, None, None
    if not rest:
        return None, None, None, None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    plural, name, sub = rest[0], (rest[1] if len(rest) > 1 else None), ("/".join(rest[2:]) or None)
    return kmock.resource(group, version, plural), namespace, name, sub


def check_write_options(method: str, params: Mapping[str, str]) -> None:
    """``fieldValidation`` and ``dryRun`` take fixed values (the real server validates the options object)."""
    options = {"POST": "CreateOptions", "PATCH": "PatchOptions", "PUT": "UpdateOptions"}.get(method)
    if options is None:
        return
    causes = []
    if (value := params.get("fieldValidation", "")) not in _FIELD_VALIDATION:
        supported = ", ".join(f'"{v}"' for v in _FIELD_VALIDATION)
        causes.append(
            (
                "FieldValueNotSupported",
                "fieldValidation",
                f'Unsupported value: "{value}": supported values: {supported}',
            )
        )
    if (value := params.get("dryRun", "All")) != "All":
        causes.append(
            ("FieldValueNotSupported", "dryRun", f'Unsupported value: ["{value}"]: supported values: "All"')
        )
    if causes:
        raise invalid(options, "meta.k8s.io", "", causes)


def parse_timeout_seconds(params: Mapping[str, str]) -> int | None:
    """Go's ``strconv.ParseInt``: ``300.0`` is no integer (the defect kopf's float setting hit)."""
    raw = params.get("timeoutSeconds")
    if raw is None or raw == "":
        return None
    if not re.fullmatch(r"[+-]?[0-9]+", raw):
        raise ApiError(400, "BadRequest", f'strconv.ParseInt: parsing "{raw}": invalid syntax')
    return int(raw)


def parse_resource_version(raw: str, *, watch: bool) -> int | None:
    """A resourceVersion parameter: etcd revisions are unsigned integers. The real server answers a bad one
    400 on a list but 500, without a reason, on a watch; both are copied."""
    if raw == "":
        return None
    if re.fullmatch(r"[0-9]+", raw):
        return int(raw)
    detail = f'resourceVersion: Invalid value: "{raw}": strconv.ParseUint: parsing "{raw}": invalid syntax'
    if watch:
        raise ApiError(500, None, detail)
    raise ApiError(400, "BadRequest", f"invalid resource version: {detail}")


def check_watch_list(params: Mapping[str, str]) -> None:
    if params.get("sendInitialEvents") == "true" and params.get("resourceVersionMatch") != "NotOlderThan":
        message = "Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan"
        raise invalid(
            "ListOptions", "meta.k8s.io", "", [("FieldValueForbidden", "resourceVersionMatch", message)]
        )


# ---------------------------------------------------------------- object metadata


def check_metadata(kind: str, group: str, plural: str, obj: Mapping[str, Any]) -> None:
    """Name and label syntax, as ``ValidateObjectMeta`` checks them on every create and update."""
    meta = obj.get("metadata") or {}
    name = meta.get("name") or ""
    causes: list[tuple[str, str, str]] = []
    if not name:
        causes.append(
            ("FieldValueRequired", "metadata.name", "Required value: name or generateName is required")
        )
    elif message := _name_error(plural, group, name):
        causes.append(("FieldValueInvalid", "metadata.name", f'Invalid value: "{name}": {message}'))
    for key, value in (meta.get("labels") or {}).items():
        if message := _qualified_name_error(key):
            causes.append(("FieldValueInvalid", "metadata.labels", f'Invalid value: "{key}": {message}'))
        if message := _label_value_error(value):
            causes.append(("FieldValueInvalid", "metadata.labels", f'Invalid value: "{value}": {message}'))
    if causes:
        raise invalid(kind, group, name, causes)


def _name_error(plural: str, group: str, name: str) -> str | None:
    # Namespaces are DNS labels and Services DNS-1035 labels (their names become DNS names); the rest are
    # DNS subdomains.
    if group == "" and plural == "namespaces":
        pattern, what, limit = _DNS1123_LABEL, "a lowercase RFC 1123 label", 63
        rule = (
            "consist of lower case alphanumeric characters or '-', and must start and end with an "
            "alphanumeric character"
        )
        example = "'my-name',  or '123-abc'"
    elif group == "" and plural == "services":
        pattern, what, limit = _DNS1035_LABEL, "a DNS-1035 label", 63
        rule = (
            "consist of lower case alphanumeric characters or '-', start with an alphabetic character, and "
            "end with an alphanumeric character"
        )
        example = "'my-name',  or 'abc-123'"
    else:
        pattern, what, limit = _DNS1123_SUBDOMAIN, "a lowercase RFC 1123 subdomain", 253
        rule = (
            "consist of lower case alphanumeric characters, '-' or '.', and must start and end with an "
            "alphanumeric character"
        )
        example = "'example.com'"
    if len(name) > limit:
        return f"must be no more than {limit} characters"
    if not re.fullmatch(pattern, name):
        return f"{what} must {rule} (e.g. {example}, regex used for validation is '{pattern}')"
    return None


def _qualified_name_error(key: str) -> str | None:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not re.fullmatch(_DNS1123_SUBDOMAIN, prefix)):
        return "prefix part must be a lowercase RFC 1123 subdomain"
    if not name or len(name) > 63 or not re.fullmatch(_QUALIFIED_NAME, name):
        return (
            "name part must be no more than 63 characters and consist of alphanumeric characters, '-', '_' "
            "or '.'"
        )
    return None


def _label_value_error(value: Any) -> str | None:
    if not isinstance(value, str):
        return "a label value must be a string"
    if len(value) > 63:
        return "must be no more than 63 bytes"
    if value and not re.fullmatch(_QUALIFIED_NAME, value):
        return "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.'"
    return None


# ---------------------------------------------------------------- selectors


def _selector_terms(selector: str) -> list[str]:
    # Commas split terms except inside "in (a,b)" sets.
    return [t.strip() for t in re.split(r",(?![^()]*\))", selector) if t.strip()]


def check_label_selector(selector: str | None) -> None:
    for term in _selector_terms(selector or ""):
        if not (
            re.fullmatch(r"\S+\s+(in|notin)\s+\(.*\)", term)
            or re.fullmatch(r"[^!=\s]+\s*(==|=|!=)\s*\S*", term)
            or re.fullmatch(r"!?[^!=\s()]+", term)
        ):
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {term!r}")


def label_selector_matches(selector: str | None, labels: Mapping[str, str]) -> bool:
    for term in _selector_terms(selector or ""):
        if m := re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", term):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if (op == "in") != (key in labels and labels[key] in values):
                return False
        elif m := re.fullmatch(r"([^!=\s]+)\s*(==|=|!=)\s*(\S*)", term):
            key, op, value = m.groups()
            if (op == "!=") == (labels.get(key) == value):
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def field_selector_matches(selector: str | None, obj: Mapping[str, Any]) -> bool:
    meta = obj.get("metadata", {})
    for term in _selector_terms(selector or ""):
        m = re.fullmatch(r"([^!=]+?)\s*(==|=|!=)\s*(.*)", term)
        if not m:
            raise ApiError(400, "BadRequest", f"invalid selector: '{term}'; can't understand '{term}'")
        field, op, value = m.groups()
        if field not in ("metadata.name", "metadata.namespace"):
            raise ApiError(400, "BadRequest", f"field label not supported: {field}")
        actual = meta.get(field.split(".", 1)[1])
        if (op == "!=") == (actual == value):
            return False
    return True


# ---------------------------------------------------------------- patches


def strip_strategic_directives(patch: Any) -> Any:
    """Drop ``$setElementOrder/...``, ``$patch``, ``$retainKeys`` and friends; what remains is applied as a
    merge patch."""
    if isinstance(patch, dict):
        return {k: strip_strategic_directives(v) for k, v in patch.items() if not k.startswith("$")}
    if isinstance(patch, list):
        return [strip_strategic_directives(v) for v in patch]
    return patch


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def unsupported_patch(custom: bool) -> ApiError:
    accepted = [t for t in PATCH_TYPES if not (custom and "strategic" in t)]
    message = "the body of the request was in an unknown format - accepted media types include: " + ", ".join(
        accepted
    )
    return ApiError(415, "UnsupportedMediaType", message)


# ---------------------------------------------------------------- requests


async def read_body(raw_request: aiohttp.web.BaseRequest) -> bytes:
    """The whole body, up to the real server's limit (aiohttp's own 1 MiB default would refuse a CRD that
    kube-apiserver takes)."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await raw_request.content.read(65536):  # a read returns what has arrived so far
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            message = f"Request entity too large: limit is {MAX_BODY_BYTES}"
            raise ApiError(413, "RequestEntityTooLarge", message)
        chunks.append(chunk)
    return b"".join(chunks)


def decode_body(body: bytes, content_type: str) -> Any:
    """The body as data, or None: JSON, or YAML for apply patches (kubectl sends those as YAML)."""
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        if content_type != APPLY_PATCH:
            return None
    try:
        return yaml.safe_load(body)
    except yaml.YAMLError:
        return None


def sent_resource_version(request: rendering.Request) -> str | None:
    """The ``metadata.resourceVersion`` a write carries. The real server parses it as an unsigned integer
    before comparing, and answers a bad one 500 without a reason."""
    data = request.data
    sent = (data.get("metadata") or {}).get("resourceVersion") if isinstance(data, dict) else None
    if sent and not str(sent).isdigit():
        raise ApiError(500, None, f'strconv.ParseUint: parsing "{sent}": invalid syntax')
    return str(sent) if sent else None


def request_action(method: enums.method, name: str | None, params: Mapping[str, str]) -> enums.action | None:
    if method == enums.method.GET:
        return (
            enums.action.WATCH
            if params.get("watch") in ("true", "1")
            else enums.action.LIST
            if name is None
            else enums.action.FETCH
        )
    return {
        enums.method.POST: enums.action.CREATE,
        enums.method.PATCH: enums.action.UPDATE,
        enums.method.PUT: enums.action.UPDATE,
        enums.method.DELETE: enums.action.DELETE,
    }.get(method)
