"""An in-memory ``KubeApi`` for unit tests: objects by (kind, namespace, name), every write recorded,
label selectors honoured, merge patches applied like the API server (RFC 7386), status subresource
writes kept apart from main-resource writes."""

from __future__ import annotations

import copy
import itertools
import uuid
from typing import Any

from pdoperator.reconcile.kinds import ResourceKind
from pdoperator.reconcile.kube import KubeApiError

from tests.k8s.api_rules import label_selector_matches, merge_patch


class FakeKubeApi:
    def __init__(self) -> None:
        self.objects: dict[tuple[ResourceKind, str, str], dict[str, Any]] = {}
        self.writes: list[tuple[str, str, str]] = []  # (verb, kind, name[/subresource])
        self.reads = 0
        self.uninstalled: set[ResourceKind] = set()  # kinds whose CRD the cluster lacks: 404 on every call
        self._revisions = itertools.count(1)

    # ---- KubeApi

    async def list(self, kind: ResourceKind, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        self.reads += 1
        self._served(kind)
        return [
            copy.deepcopy(obj)
            for (k, ns, _), obj in self.objects.items()
            if k == kind
            and ns == namespace
            and label_selector_matches(label_selector, obj["metadata"].get("labels") or {})
        ]

    async def get(self, kind: ResourceKind, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    async def create(self, kind: ResourceKind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        self.writes.append(("create", kind.kind, name))
        self._served(kind)
        if (kind, namespace, name) in self.objects:
            raise KubeApiError(409, "AlreadyExists", f"{name} exists")
        obj = copy.deepcopy(body)
        obj["metadata"].update(
            namespace=namespace,
            uid=str(uuid.uuid4()),
            generation=1,
            resourceVersion=str(next(self._revisions)),
        )
        self.objects[(kind, namespace, name)] = obj
        return copy.deepcopy(obj)

    async def patch(
        self,
        kind: ResourceKind,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        self.writes.append(("patch", kind.kind, f"{name}/{subresource}" if subresource else name))
        old = self.objects.get((kind, namespace, name))
        if old is None:
            raise KubeApiError(404, "NotFound", f"{name} not found")
        if subresource == "status":
            new = {**old, "status": merge_patch(old.get("status") or {}, patch.get("status") or {})}
        else:
            new = merge_patch(old, {k: v for k, v in patch.items() if k != "status"})
            if {k: v for k, v in new.items() if k not in ("metadata", "status")} != {
                k: v for k, v in old.items() if k not in ("metadata", "status")
            }:
                new["metadata"]["generation"] = old["metadata"]["generation"] + 1
        new["metadata"]["resourceVersion"] = str(next(self._revisions))
        self.objects[(kind, namespace, name)] = new
        return copy.deepcopy(new)

    async def delete(self, kind: ResourceKind, namespace: str, name: str) -> bool:
        self.writes.append(("delete", kind.kind, name))
        return self.objects.pop((kind, namespace, name), None) is not None

    # ---- test helpers

    def _served(self, kind: ResourceKind) -> None:
        if kind in self.uninstalled:
            raise KubeApiError(
                404, "NotFound", f"the server could not find the requested resource ({kind.plural})"
            )

    def put(self, kind: ResourceKind, body: dict[str, Any]) -> dict[str, Any]:
        meta = body.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("generation", 1)
        meta["resourceVersion"] = str(next(self._revisions))
        self.objects[(kind, meta["namespace"], meta["name"])] = body
        return body

    def obj(self, kind: ResourceKind, namespace: str, name: str) -> dict[str, Any]:
        return self.objects[(kind, namespace, name)]


class RecordedEvents:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def __call__(self, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))

    def reasons(self) -> list[str]:
        return [reason for _, reason, _ in self.events]
