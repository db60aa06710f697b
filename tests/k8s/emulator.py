"""A Kubernetes API server for tests: kmock 0.8's ``KubernetesEmulator``, completed enough for kopf and
kubectl.

kmock 0.8 stores objects in memory and serves them over HTTP, but as shipped neither kopf nor
kubectl can work against it. This subclass (``ApiServerEmulator``) keeps kmock's server, request
recording (``list(emulator)``), discovery scaffold and object store (``emulator.objects``) and
replaces the resource endpoints with behaviour close to a real kube-apiserver:

- metadata: ``uid``, ``resourceVersion`` (one global counter), ``generation`` (bumped when
  anything but metadata/status changes), ``creationTimestamp``, ``generateName``;
- optimistic concurrency: a stale ``metadata.resourceVersion`` in a write answers 409;
  a failed JSON-patch ``test`` op answers 422 (kopf relies on it for finalizers);
- patches: merge (RFC 7386), JSON patch (RFC 6902), strategic merge treated as merge after
  dropping ``$``-directives (lists are replaced, not merged by key), apply patches as merge;
  ``PUT`` replaces; a write that changes nothing bumps nothing and emits no event;
- status subresource: ``/status`` writes change only ``.status``; main-resource writes keep it;
- deletion: objects with finalizers get ``deletionTimestamp`` and go away when the last
  finalizer is removed;
- lists carry ``kind: <Kind>List``, ``apiVersion`` and the current ``resourceVersion``;
  ``labelSelector`` (=, ==, !=, in, notin, exists, !exists) and ``fieldSelector``
  (metadata.name, metadata.namespace) filter lists and watches;
- watches: served as ``application/json`` lines; ``resourceVersion=N`` replays every event after
  N from the event log, without it the stream starts with the current objects taken atomically
  with the subscription; ``sendInitialEvents`` ends the initial batch with the
  ``k8s.io/initial-events-end`` bookmark; ``timeoutSeconds`` ends the stream;
- discovery: core ``groupVersion`` is ``v1`` (kmock says ``/v1``); built-in kinds are declared up
  front and a created CustomResourceDefinition makes its resource discoverable (namespaced or
  not, short names, status subresource), as the real server does;
- ``/api/v1/namespaces`` (list) and ``/api/v1/namespaces/NAME`` are routed to the namespaces
  resource (kmock's path parser takes them for a namespace scope).

Not emulated: protobuf bodies (answered 415; ``kubectl create namespace`` sends protobuf, ``kubectl
apply`` sends JSON), schema validation or defaulting of any kind (no CEL, no OpenAPI pruning), garbage
collection by ownerReferences, controllers (StatefulSets never get pods or status unless a test
writes it), admission, authorization (every request is allowed: see ``rbac_requests``), table
output (kubectl falls back to client-side printing), server-side apply field ownership.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import re
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import yaml
from kmock._internal import enums, rendering

STATUS_SUBRESOURCE = "status"

# Built-in resources the operator and kubectl touch: (group/version/plural, kind, namespaced, subresources,
# short names).
_BUILTINS: tuple[tuple[str, str, bool, tuple[str, ...], tuple[str, ...]], ...] = (
    ("v1/namespaces", "Namespace", False, ("status",), ("ns",)),
    ("v1/configmaps", "ConfigMap", True, (), ("cm",)),
    ("v1/secrets", "Secret", True, (), ()),
    ("v1/services", "Service", True, ("status",), ("svc",)),
    ("v1/endpoints", "Endpoints", True, (), ("ep",)),
    ("v1/pods", "Pod", True, ("status",), ("po",)),
    ("v1/events", "Event", True, (), ("ev",)),
    ("v1/serviceaccounts", "ServiceAccount", True, (), ("sa",)),
    ("apps/v1/statefulsets", "StatefulSet", True, ("status", "scale"), ("sts",)),
    ("apps/v1/deployments", "Deployment", True, ("status", "scale"), ("deploy",)),
    ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", True, ("status",), ("pdb",)),
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True, (), ("netpol",)),
    ("discovery.k8s.io/v1/endpointslices", "EndpointSlice", True, (), ()),
    ("events.k8s.io/v1/events", "Event", True, (), ("ev",)),
    ("coordination.k8s.io/v1/leases", "Lease", True, (), ()),
    (
        "apiextensions.k8s.io/v1/customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        ("status",),
        ("crd", "crds"),
    ),
    ("rbac.authorization.k8s.io/v1/roles", "Role", True, (), ()),
    ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding", True, (), ()),
    ("rbac.authorization.k8s.io/v1/clusterroles", "ClusterRole", False, (), ()),
    ("rbac.authorization.k8s.io/v1/clusterrolebindings", "ClusterRoleBinding", False, (), ()),
)
_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NAMESPACES = kmock.resource("", "v1", "namespaces")


class ApiError(Exception):
    """A failure answered with a Kubernetes ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def response(self) -> aiohttp.web.Response:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
        body |= {"message": self.message, "reason": self.reason, "code": self.code}
        return aiohttp.web.json_response(body, status=self.code)


@attrs.frozen
class WatchEvent:
    revision: int
    resource: kmock.resource
    type: str
    object: dict[str, Any]


# ---------------------------------------------------------------- pure helpers


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


def _selector_terms(selector: str) -> list[str]:
    # Commas split terms except inside "in (a,b)" sets.
    return [t.strip() for t in re.split(r",(?![^()]*\))", selector) if t.strip()]


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
            raise ApiError(400, "BadRequest", f"invalid field selector term {term!r}")
        field, op, value = m.groups()
        if field not in ("metadata.name", "metadata.namespace"):
            raise ApiError(400, "BadRequest", f"field label not supported: {field}")
        actual = meta.get(field.split(".", 1)[1])
        if (op == "!=") == (actual == value):
            return False
    return True


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


def _generation_relevant(obj: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------- the emulator


@attrs.define(kw_only=True)
class ApiServerEmulator(kmock.KubernetesEmulator):
    """kmock's emulator completed for kopf and kubectl (see the module docstring for the list)."""

    _revision: int = attrs.field(default=0, init=False)
    _events: list[WatchEvent] = attrs.field(factory=list, init=False)
    _changed: asyncio.Condition = attrs.field(factory=asyncio.Condition, init=False)
    # Objects created through the API, per resource (kmock's store is one flat dict): lists stay cheap.
    _by_resource: dict[kmock.resource, dict[tuple[str | None, str], kmock.Object]] = attrs.field(
        factory=dict, init=False
    )

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, kind, namespaced, subresources, shortnames in _BUILTINS:
            self.resources[key] = kmock.ResourceInfo(
                kind=kind,
                singular=kind.lower(),
                namespaced=namespaced,
                verbs=set(_VERBS),
                subresources=set(subresources),
                shortnames=set(shortnames),
            )

    # ---- requests: own parsing (kmock's parser breaks on /api/v1/namespaces) and routing

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        body = await raw_request.read()
        resource, namespace, name, subresource = parse_k8s_path(raw_request.path)
        if resource is None:
            return await super().__call__(raw_request)
        data: Any = None
        if body and "protobuf" in raw_request.headers.get("Content-Type", ""):
            return ApiError(
                415, "UnsupportedMediaType", "the emulator speaks JSON and YAML only, not protobuf"
            ).response()
        if body:
            try:
                data = json.loads(body)
            except ValueError:
                try:
                    data = yaml.safe_load(body)  # apply patches may be YAML
                except yaml.YAMLError:
                    data = None
        method = enums.method(raw_request.method)
        params = dict(raw_request.query)
        action = _action(method, name, params)
        request = rendering.Request(
            id=len(self._requests),
            raw_request=raw_request,
            url=raw_request.url,
            method=raw_request.method,
            params=params,
            headers=dict(raw_request.headers),
            data=data,
            body=body,
            text=body.decode(errors="replace"),
            action=action,
            resource=resource,
            namespace=namespace,
            name=name,
            subresource=subresource,
        )
        self._requests.append(request)
        try:
            return await self._serve_resource(request)
        except ApiError as e:
            return e.response()

    async def _serve_resource(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        assert request.resource is not None
        info = self._info(request.resource)
        if info is None:
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource ({request.resource})"
            )
        if request.subresource not in (None, STATUS_SUBRESOURCE):
            raise ApiError(404, "NotFound", f"subresource {request.subresource!r} is not emulated")
        namespace = request.namespace if info.namespaced else None
        method = request.method
        if method == enums.method.GET and request.params.get("watch") in ("true", "1"):
            return await self._watch(request, info)
        if method == enums.method.GET and request.name is None:
            return aiohttp.web.json_response(await self._list(request, info))
        if method == enums.method.GET:
            return aiohttp.web.json_response(self._get(request.resource, namespace, request.name, info).raw)
        if method == enums.method.POST and request.name is None:
            return aiohttp.web.json_response(await self._create(request, info, namespace), status=201)
        if method in (enums.method.PATCH, enums.method.PUT) and request.name is not None:
            return aiohttp.web.json_response(await self._write(request, info, namespace))
        if method == enums.method.DELETE and request.name is not None:
            return aiohttp.web.json_response(
                await self._delete(request.resource, namespace, request.name, info)
            )
        raise ApiError(405, "MethodNotAllowed", f"{method.value} is not supported on {request.url.path}")

    # ---- discovery

    def _info(self, resource: kmock.resource) -> kmock.ResourceInfo | None:
        return self.resources.get(resource)

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        payload = await super()._serve_version(request)
        assert isinstance(payload, dict) and request.resource is not None
        if request.resource.group == "":
            payload["groupVersion"] = request.resource.version
        for entry in payload["resources"]:
            if "/" in entry["name"]:  # subresources have no short names of their own
                entry["shortNames"] = []
        return payload

    def _register_crd(self, crd: Mapping[str, Any]) -> None:
        spec = crd.get("spec", {})
        names = spec.get("names", {})
        for version in spec.get("versions", []):
            if not version.get("served", True):
                continue
            key = kmock.resource(spec["group"], version["name"], names["plural"])
            self.resources[key] = kmock.ResourceInfo(
                kind=names["kind"],
                singular=names.get("singular", names["kind"].lower()),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                verbs=set(_VERBS),
                subresources={"status"} if "status" in version.get("subresources", {}) else set(),
                shortnames=set(names.get("shortNames", [])),
                categories=set(names.get("categories", [])),
            )

    def _unregister_crd(self, crd: Mapping[str, Any]) -> None:
        spec = crd.get("spec", {})
        for version in spec.get("versions", []):
            key = kmock.resource(spec["group"], version["name"], spec["names"]["plural"])
            if key in self.resources:
                del self.resources[key]

    # ---- storage

    def _live(self, resource: kmock.resource, namespace: str | None, name: str) -> kmock.Object | None:
        key = (resource, namespace, name)
        if key in self.objects and not self.objects[key].deleted:
            return self.objects[key]
        return None

    def _get(
        self, resource: kmock.resource, namespace: str | None, name: str, info: kmock.ResourceInfo
    ) -> kmock.Object:
        obj = self._live(resource, namespace, name)
        if obj is None:
            raise ApiError(404, "NotFound", f'{resource.plural} "{name}" not found')
        return obj

    async def _emit(self, resource: kmock.resource, type_: str, obj: dict[str, Any]) -> None:
        self._events.append(WatchEvent(self._revision, resource, type_, obj))
        async with self._changed:
            self._changed.notify_all()

    def _next_revision(self) -> str:
        self._revision += 1
        return str(self._revision)

    async def _create(
        self, request: rendering.Request, info: kmock.ResourceInfo, namespace: str | None
    ) -> dict[str, Any]:
        assert request.resource is not None
        if not isinstance(request.data, dict):
            raise ApiError(400, "BadRequest", "the body of a create must be an object")
        if request.params.get("dryRun"):
            return request.data
        obj = copy.deepcopy(request.data)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        name = meta.get("name")
        if not name:
            raise ApiError(422, "Invalid", "metadata.name: Required value: name or generateName is required")
        if info.namespaced:
            meta["namespace"] = namespace or meta.get("namespace") or "default"
        else:
            meta.pop("namespace", None)
        if STATUS_SUBRESOURCE in info.subresources:
            obj.pop("status", None)
        async with self._lock:
            key = (request.resource, meta.get("namespace"), name)
            if self._live(*key) is not None:
                raise ApiError(409, "AlreadyExists", f'{request.resource.plural} "{name}" already exists')
            meta.update(
                uid=str(uuid.uuid4()),
                resourceVersion=self._next_revision(),
                generation=1,
                creationTimestamp=_now(),
            )
            if key in self.objects:
                self.objects[key].create(obj)
            else:
                self.objects[key] = obj
                self._by_resource.setdefault(request.resource, {})[key[1:]] = self.objects[key]
            if request.resource == CRDS:
                self._register_crd(obj)
            await self._emit(request.resource, "ADDED", obj)
        return obj

    async def _write(
        self, request: rendering.Request, info: kmock.ResourceInfo, namespace: str | None
    ) -> dict[str, Any]:
        assert request.resource is not None and request.name is not None
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        async with self._lock:
            live = self._live(request.resource, namespace, request.name)
            if live is None:
                raise ApiError(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
            old = copy.deepcopy(live.raw)
            new = self._patched(old, request, content_type)
            if request.params.get("dryRun"):
                return new
            sent_version = (
                (request.data or {}).get("metadata", {}).get("resourceVersion")
                if isinstance(request.data, dict)
                else None
            )
            if sent_version and sent_version != old["metadata"].get("resourceVersion"):
                message = (
                    f'Operation cannot be fulfilled on {request.resource.plural} "{request.name}": '
                    "the object has been modified"
                )
                raise ApiError(409, "Conflict", message)
            new = self._restrict_to_scope(old, new, request.subresource, info)
            if new == old:
                return old
            if _generation_relevant(new) != _generation_relevant(old):
                new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
            new["metadata"]["resourceVersion"] = self._next_revision()
            key = (request.resource, namespace, request.name)
            meta = new["metadata"]
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                self.objects[key].delete()
                await self._emit(request.resource, "DELETED", new)
            else:
                self.objects[key].history.append(new)
                await self._emit(request.resource, "MODIFIED", new)
        return new

    @staticmethod
    def _patched(old: dict[str, Any], request: rendering.Request, content_type: str) -> dict[str, Any]:
        data = request.data
        if request.method == enums.method.PUT:
            if not isinstance(data, dict):
                raise ApiError(400, "BadRequest", "the body of an update must be an object")
            return copy.deepcopy(data)
        if content_type == "application/json-patch+json":
            if not isinstance(data, list):
                raise ApiError(400, "BadRequest", "a JSON patch must be a list of operations")
            try:
                return jsonpatch.apply_patch(old, data)
            except jsonpatch.JsonPatchTestFailed as e:
                raise ApiError(422, "Invalid", f"the JSON patch test failed: {e}") from e
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                raise ApiError(422, "Invalid", f"the JSON patch cannot be applied: {e}") from e
        if not isinstance(data, dict):
            raise ApiError(400, "BadRequest", "a merge patch must be an object")
        if content_type == "application/strategic-merge-patch+json":
            data = strip_strategic_directives(data)
        return merge_patch(old, data)

    @staticmethod
    def _restrict_to_scope(
        old: dict[str, Any], new: dict[str, Any], subresource: str | None, info: kmock.ResourceInfo
    ) -> dict[str, Any]:
        """Identity fields never change; with a status subresource, each endpoint writes only its own half."""
        result = copy.deepcopy(new)
        if STATUS_SUBRESOURCE in info.subresources:
            if subresource == STATUS_SUBRESOURCE:
                result = {**copy.deepcopy(old), "status": result.get("status")}
                if result["status"] is None:
                    del result["status"]
            elif "status" in old:
                result["status"] = copy.deepcopy(old["status"])
            else:
                result.pop("status", None)
        meta = result.setdefault("metadata", {})
        for field in (
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "generation",
            "resourceVersion",
        ):
            if field in old["metadata"]:
                meta[field] = old["metadata"][field]
            else:
                meta.pop(field, None)
        return result

    async def _delete(
        self, resource: kmock.resource, namespace: str | None, name: str, info: kmock.ResourceInfo
    ) -> dict[str, Any]:
        async with self._lock:
            live = self._get(resource, namespace, name, info)
            obj = copy.deepcopy(live.raw)
            meta = obj["metadata"]
            if meta.get("finalizers"):
                if not meta.get("deletionTimestamp"):
                    meta["deletionTimestamp"] = _now()
                    meta["resourceVersion"] = self._next_revision()
                    live.history.append(obj)
                    await self._emit(resource, "MODIFIED", obj)
                return obj
            meta["resourceVersion"] = self._next_revision()
            live.delete()
            if resource == CRDS:
                self._unregister_crd(obj)
            await self._emit(resource, "DELETED", obj)
        return obj

    # ---- reading

    def _matching(self, request: rendering.Request, info: kmock.ResourceInfo, obj: Mapping[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        if info.namespaced and request.namespace is not None and meta.get("namespace") != request.namespace:
            return False
        if request.name is not None and meta.get("name") != request.name:
            return False
        return label_selector_matches(
            request.params.get("labelSelector"), meta.get("labels") or {}
        ) and field_selector_matches(request.params.get("fieldSelector"), obj)

    def _snapshot(self, request: rendering.Request, info: kmock.ResourceInfo) -> list[dict[str, Any]]:
        assert request.resource is not None
        candidates = self._by_resource.get(request.resource, {}).values()
        return [obj.raw for obj in candidates if not obj.deleted and self._matching(request, info, obj.raw)]

    async def _list(self, request: rendering.Request, info: kmock.ResourceInfo) -> dict[str, Any]:
        assert request.resource is not None
        async with self._lock:
            items = self._snapshot(request, info)
            revision = str(self._revision)
        api_version = f"{request.resource.group}/{request.resource.version}".lstrip("/")
        return {
            "kind": f"{info.kind}List",
            "apiVersion": api_version,
            "metadata": {"resourceVersion": revision},
            "items": items,
        }

    async def _watch(
        self, request: rendering.Request, info: kmock.ResourceInfo
    ) -> aiohttp.web.StreamResponse:
        assert request.resource is not None and request._raw_request is not None
        since = request.params.get("resourceVersion") or ""
        initial_events = request.params.get("sendInitialEvents") == "true" or since in ("", "0")
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        async with self._lock:
            if initial_events:
                backlog = [{"type": "ADDED", "object": obj} for obj in self._snapshot(request, info)]
                cursor = len(self._events)
            else:
                if not since.isdigit():
                    raise ApiError(400, "BadRequest", f"invalid resourceVersion {since!r}")
                cursor = next(
                    (i for i, e in enumerate(self._events) if e.revision > int(since)), len(self._events)
                )
                backlog = []
            revision = str(self._revision)
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        if (
            request.params.get("sendInitialEvents") == "true"
            and request.params.get("allowWatchBookmarks") == "true"
        ):
            bookmark = {
                "kind": info.kind,
                "apiVersion": f"{request.resource.group}/{request.resource.version}".lstrip("/"),
                "metadata": {
                    "resourceVersion": revision,
                    "annotations": {"k8s.io/initial-events-end": "true"},
                },
            }
            backlog.append({"type": "BOOKMARK", "object": bookmark})
        try:  # the client may go away at any point: that ends the watch
            await response.prepare(request._raw_request)
            for event in backlog:
                await response.write(json.dumps(event).encode() + b"\n")
            async with asyncio.timeout(timeout):
                while True:
                    events, cursor = self._events[cursor:], len(self._events)
                    for event in self._relevant(events, request, info):
                        await response.write(
                            json.dumps({"type": event.type, "object": event.object}).encode() + b"\n"
                        )
                    async with self._changed:
                        if cursor == len(self._events):
                            await self._changed.wait()
        except (TimeoutError, ConnectionError):
            pass
        return response

    def _relevant(
        self, events: Iterable[WatchEvent], request: rendering.Request, info: kmock.ResourceInfo
    ) -> Iterable[WatchEvent]:
        return (
            e for e in events if e.resource == request.resource and self._matching(request, info, e.object)
        )

    # ---- for tests

    def live_objects(self, resource: str) -> list[dict[str, Any]]:
        """Current objects of one resource (``"apps/v1/statefulsets"``), for assertions."""
        return [
            obj.raw for obj in self._by_resource.get(kmock.resource(resource), {}).values() if not obj.deleted
        ]


def _action(method: enums.method, name: str | None, params: Mapping[str, str]) -> enums.action | None:
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
