"""Desired vs live: does a child need a write, and which merge patch brings it back.

The API server adds fields the operator never sets (defaults such as ``imagePullPolicy``,
``clusterIP``, ``terminationMessagePath``; status; metadata). So "unchanged" means: every
field the operator renders is present in the live object with the rendered value — the
desired object is a *subset* of the live one. Lists must match element by element (each
element again as a subset) because the operator owns whole lists (containers, ports, env).

Fields the operator stops rendering (a GPU limit dropped, a nodeSelector key removed) must be
removed from the live object, which a subset test cannot see. Like ``kubectl apply``, the
operator records what it last applied in an annotation and nulls keys that were applied
before and are no longer desired (a three-way merge patch, RFC 7386).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

from pdoperator.api.model import GROUP

LAST_APPLIED_ANNOTATION = f"{GROUP}/last-applied"


def _is_empty(value: Any) -> bool:
    return value is None or value in ({}, [])


def is_subset(desired: Any, live: Any) -> bool:
    """True when every field of ``desired`` is in ``live`` with the same value (empty values match absent
    ones)."""
    if desired is None:
        return True
    if isinstance(desired, dict):
        if live is None:
            return all(is_subset(v, None) for v in desired.values()) if desired else True
        return isinstance(live, dict) and all(is_subset(v, live.get(k)) for k, v in desired.items())
    if isinstance(desired, list):
        if not desired:
            return _is_empty(live)
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(is_subset(d, x) for d, x in zip(desired, live, strict=True))
        )
    return bool(desired == live)


def merge_patch(
    last_applied: dict[str, Any], desired: dict[str, Any], live: dict[str, Any]
) -> dict[str, Any]:
    """The smallest RFC 7386 patch after which ``desired`` is a subset of ``live`` and keys applied last time
    but no longer desired are gone. Empty when nothing needs to change."""
    patch: dict[str, Any] = {}
    for key, want in desired.items():
        have = live.get(key)
        if isinstance(want, dict) and isinstance(have, dict):
            before = last_applied.get(key)
            sub = merge_patch(before if isinstance(before, dict) else {}, want, have)
            if sub:
                patch[key] = sub
        elif not is_subset(want, have):
            patch[key] = copy.deepcopy(want)
    for key in last_applied:
        if key not in desired and key in live:
            patch[key] = None
    return patch


def with_last_applied(desired: dict[str, Any], unrecorded: Sequence[tuple[str, ...]] = ()) -> dict[str, Any]:
    """``desired`` carrying its own compact JSON in the last-applied annotation.

    ``unrecorded`` names fields another controller owns once the child exists (the replicas of a StatefulSet
    an HPA scales): rendered with the value they have, so a new child starts right and a live one needs no
    write, and left out of the record, so their owner changing them never makes the operator write."""
    result = copy.deepcopy(desired)
    record = copy.deepcopy(desired)
    for *parents, key in unrecorded:
        parent = _at(record, tuple(parents))
        if isinstance(parent, dict):
            parent.pop(key, None)
    annotations = result.setdefault("metadata", {}).setdefault("annotations", {})
    annotations[LAST_APPLIED_ANNOTATION] = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return result


def last_applied_of(live: dict[str, Any]) -> dict[str, Any]:
    """What the operator applied to ``live`` last time (empty when unknown or unreadable)."""
    text = (live.get("metadata", {}).get("annotations") or {}).get(LAST_APPLIED_ANNOTATION)
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def child_patch(
    desired: dict[str, Any], live: dict[str, Any], exclusive: Sequence[tuple[str, ...]] = ()
) -> dict[str, Any]:
    """The merge patch that restores a child to ``desired`` (as produced by ``with_last_applied``); empty if
    none.

    ``exclusive`` names maps the operator owns entirely (a ConfigMap's ``data``): keys someone
    else added there are removed too, as if the operator had applied them before.
    """
    last = last_applied_of(live)
    for path in exclusive:
        live_map = _at(live, path)
        if isinstance(live_map, dict):
            owned = last
            for key in path:
                owned = owned.setdefault(key, {})
            for key in live_map:
                owned.setdefault(key, live_map[key])
    return merge_patch(last, desired, live)


def _at(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj
