"""Which writes bring a PDService's children to the rendered state (pure).

Desired children are the rendered manifests plus the controller ownerReference and the
last-applied annotation; live children are what a label-selected list returned, per kind.
The plan creates what is missing (in render order), patches what drifted (only the fields
that differ), and deletes children this PDService controls that are no longer rendered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdoperator.api.autoscaling import AutoscalingEngine
from pdoperator.api.model import PDService
from pdoperator.render import RenderDefaults, owner_reference, render_pdservice
from pdoperator.render.names import LABEL_INSTANCE, LABEL_NAME, PRODUCT

from .diff import child_patch, with_last_applied
from .kinds import CONFIGMAPS, ResourceKind, kind_of

# Maps the operator owns entirely: keys added by hand are removed, not only changed values restored.
EXCLUSIVE_FIELDS: dict[ResourceKind, tuple[tuple[str, ...], ...]] = {CONFIGMAPS: (("data",), ("binaryData",))}


def children_selector(pds_name: str) -> str:
    """The label selector of every child of one PDService."""
    return f"{LABEL_NAME}={PRODUCT},{LABEL_INSTANCE}={pds_name}"


def desired_children(pds: PDService, defaults: RenderDefaults) -> list[dict[str, Any]]:
    scaling = pds.spec.autoscaling
    scaled_by_others = scaling is not None and scaling.engine is not AutoscalingEngine.BUILTIN
    children = []
    for manifest in render_pdservice(pds, defaults):
        manifest.setdefault("metadata", {})["ownerReferences"] = [owner_reference(pds)]
        unrecorded = [("spec", "replicas")] if scaled_by_others and manifest["kind"] == "StatefulSet" else []
        children.append(with_last_applied(manifest, unrecorded))
    return children


@dataclass(frozen=True)
class Create:
    kind: ResourceKind
    body: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])


@dataclass(frozen=True)
class Patch:
    kind: ResourceKind
    name: str
    patch: dict[str, Any]
    desired: dict[str, Any]  # to recreate the child when the patch touches an immutable field


@dataclass(frozen=True)
class Delete:
    kind: ResourceKind
    name: str


Action = Create | Patch | Delete


def describe(action: Action) -> str:
    verb = {Create: "created", Patch: "updated", Delete: "deleted"}[type(action)]
    return f"{verb} {action.kind.kind} {action.name}"


def _controlled_by(obj: Mapping[str, Any], owner_uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("controller") and ref.get("uid") == owner_uid for ref in refs)


def plan(
    desired: list[dict[str, Any]], live: Mapping[ResourceKind, list[dict[str, Any]]], owner_uid: str
) -> list[Action]:
    live_by_name = {(kind, obj["metadata"]["name"]): obj for kind, objs in live.items() for obj in objs}
    actions: list[Action] = []
    wanted = set()
    for child in desired:
        kind = kind_of(child)
        name = child["metadata"]["name"]
        wanted.add((kind, name))
        current = live_by_name.get((kind, name))
        if current is None:
            actions.append(Create(kind, child))
        elif current.get("metadata", {}).get("deletionTimestamp"):
            continue  # recreated once it is gone: its DELETED event triggers another reconcile
        elif patch := child_patch(child, current, EXCLUSIVE_FIELDS.get(kind, ())):
            actions.append(Patch(kind, name, patch, child))
    for (kind, name), obj in live_by_name.items():
        if (kind, name) not in wanted and _controlled_by(obj, owner_uid):
            actions.append(Delete(kind, name))
    return actions
