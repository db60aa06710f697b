"""Reading YAML manifests into plain documents, with errors instead of tracebacks.

Mirrors what ``kubectl`` does with a file: several ``---`` documents, empty ones
skipped, ``kind: List`` flattened, dates left as the strings they were written as.
It also refuses what ``kubectl`` refuses or should: duplicate keys (PyYAML would
silently keep the last one), alias cycles and alias bombs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pdoperator.api.errors import FieldError, SpecError, type_name

# Nodes a document may expand to through YAML aliases ("billion laughs" protection).
MAX_EXPANDED_NODES = 1_000_000


# libyaml's parser when PyYAML has it: much faster, and it bounds nesting depth by itself.
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_SafeLoader):
    """The safe loader without timestamp conversion, rejecting duplicate keys."""

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in _SafeLoader.yaml_implicit_resolvers.items()
    }

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                # keys merged in with `<<` may be overridden; only the node's own keys must be unique
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, "found an unhashable key", key_node.start_mark
                ) from None
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _describe_yaml_error(error: yaml.YAMLError) -> str:
    if isinstance(error, yaml.reader.ReaderError):
        code = error.character if isinstance(error.character, int) else ord(error.character)
        return f"position {error.position}: unacceptable character #x{code:04x}: {error.reason}"
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        problem = error.problem or str(error)
        context = f" ({error.context})" if error.context else ""
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}{context}"
    return str(error).replace("\n", " ")


def _expanded_size(value: Any, memo: dict[int, int], active: set[int]) -> int:
    """How many nodes ``value`` has with every alias expanded; ValueError on an alias cycle."""
    if not isinstance(value, dict | list):
        return 1
    key = id(value)
    if key in memo:
        return memo[key]
    if key in active:
        raise ValueError("a YAML alias refers to its own ancestor")
    active.add(key)
    children = value.values() if isinstance(value, dict) else value
    total = 1 + sum(_expanded_size(child, memo, active) for child in children)
    active.discard(key)
    memo[key] = total
    return total


def _objects_of(document: Any, index: int) -> list[dict[str, Any]]:
    """The Kubernetes objects in one YAML document (a ``kind: List`` holds several)."""
    where = f"document {index}"
    if not isinstance(document, dict):
        raise SpecError(
            [FieldError(where, f"must be a mapping (a Kubernetes object), got {type_name(document)}")]
        )
    try:
        size = _expanded_size(document, {}, set())
    except ValueError as error:
        raise SpecError([FieldError(where, str(error))]) from None
    if size > MAX_EXPANDED_NODES:
        raise SpecError(
            [FieldError(where, f"expands to more than {MAX_EXPANDED_NODES} nodes through YAML aliases")]
        )
    if document.get("kind") == "List" and isinstance(document.get("items"), list):
        for position, item in enumerate(document["items"]):
            if not isinstance(item, dict):
                raise SpecError(
                    [
                        FieldError(
                            f"{where}: items[{position}]",
                            f"must be a mapping (a Kubernetes object), got {type_name(item)}",
                        )
                    ]
                )
        return list(document["items"])
    return [document]


def load_documents(source: str | bytes | Path) -> list[dict[str, Any]]:
    """The objects in a YAML stream: a ``Path`` is read from disk, ``str``/``bytes`` are the YAML text.

    Raises ``OSError`` when a path cannot be read and ``SpecError`` when the content is
    not YAML made of Kubernetes objects (paths ``yaml`` or ``document N``, counted from 1).
    """
    raw = source.read_bytes() if isinstance(source, Path) else source
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as error:
            raise SpecError(
                [
                    FieldError(
                        "yaml", f"not UTF-8 text (byte {error.start}: {raw[error.start : error.start + 1]!r})"
                    )
                ]
            ) from None
    else:
        text = raw
    try:
        documents = list(yaml.load_all(text, Loader=_Loader))
    except yaml.YAMLError as error:
        raise SpecError([FieldError("yaml", _describe_yaml_error(error))]) from None
    except RecursionError:
        raise SpecError([FieldError("yaml", "nested too deeply")]) from None
    objects: list[dict[str, Any]] = []
    for index, document in enumerate(documents, start=1):
        if document is not None:
            try:
                objects.extend(_objects_of(document, index))
            except RecursionError:
                raise SpecError([FieldError(f"document {index}", "nested too deeply")]) from None
    return objects
