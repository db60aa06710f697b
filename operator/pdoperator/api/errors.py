"""Validation errors that name the field they are about."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class FieldError:
    """One problem with one field, e.g. ``spec.ssm.convStateLayout: must be DS when ...``."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecError(Exception):
    """A PDService (or the document holding it) is invalid; ``errors`` lists every problem found."""

    def __init__(self, errors: list[FieldError]) -> None:
        if not errors:
            raise ValueError("SpecError needs at least one FieldError")
        self.errors = list(errors)
        super().__init__("\n".join(str(error) for error in self.errors))


def path_key(key: str) -> str:
    """A map key or field name as it appears in a field path: quoted when it would break the line or blur the
    path."""
    return key if key.isprintable() and key.strip() == key and key else json.dumps(key)


def type_name(value: object) -> str:
    """How an error message names the JSON type of a value ("a list", "a string", "null")."""
    names = {
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)
