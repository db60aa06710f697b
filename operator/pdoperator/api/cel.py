"""A cross-field rule written twice: CEL for the API server, a Python twin for ``pdctl validate`` and the
operator (``pdoperator.api.rules`` explains how the two are kept in agreement)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Reason(StrEnum):
    """How the API server classifies a failed rule (``reason`` of a validation rule)."""

    INVALID = "FieldValueInvalid"
    FORBIDDEN = "FieldValueForbidden"
    REQUIRED = "FieldValueRequired"


@dataclass(frozen=True)
class CelRule:
    """A rule on every object of type ``owner``: CEL for the API server, ``holds`` for Python.

    ``field_path`` (a JSONPath relative to the owner, like ``.ssm.family``) names the field the
    error is reported on; empty reports it on the owner object itself.
    """

    name: str
    owner: type
    cel: str
    message: str
    holds: Callable[[Any], bool]
    field_path: str = ""
    reason: Reason = Reason.INVALID

    def validation(self) -> dict[str, str]:
        """The ``x-kubernetes-validations`` entry of this rule."""
        entry = {"rule": self.cel, "message": self.message}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        if self.reason is not Reason.INVALID:
            entry["reason"] = self.reason.value
        return entry
