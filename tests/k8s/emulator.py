"""A Kubernetes API server for tests: kmock 0.8's ``KubernetesEmulator``, completed enough for kopf and
kubectl, and the front of the one world the operator tests run in.

kmock 0.8 stores objects in memory and serves them over HTTP, but as shipped neither kopf nor
kubectl can work against it. This subclass (``ApiServerEmulator``) keeps kmock's server, request
recording (``list(emulator)``), discovery scaffold and object store (``emulator.objects``) and
replaces the resource endpoints with behaviour close to a real kube-apiserver:

- metadata: ``uid``, ``resourceVersion`` (one global counter), ``generation`` (bumped when
  anything but metadata/status changes, and once when deletion starts), ``creationTimestamp``,
  ``generateName``; names and labels checked as ``ValidateObjectMeta`` does (422);
- namespaces: ``default``, ``kube-system``, ``kube-public`` and ``kube-node-lease`` exist; a create in
  any other namespace needs its Namespace first (404, as the NamespaceLifecycle admission plugin);
- optimistic concurrency: a stale ``metadata.resourceVersion`` in a write answers 409;
  a failed JSON-patch ``test`` op answers 422 (kopf relies on it for finalizers);
- patches: merge (RFC 7386), JSON patch (RFC 6902), strategic merge treated as merge after
  dropping ``$``-directives (lists are replaced, not merged by key; custom resources answer 415 as
  the real server does), apply patches (``fieldManager`` required) as merge; any other type 415;
  ``PUT`` replaces (custom resources need ``metadata.resourceVersion``); a write that changes
  nothing bumps nothing and emits no event;
- status subresource: ``/status`` writes change only ``.status``; main-resource writes keep it;
- deletion: objects with finalizers get ``deletionTimestamp`` and go away when the last
  finalizer is removed; an immediate deletion answers a ``Success`` Status;
- lists sorted by namespace and name as etcd returns them, with ``kind: <Kind>List``,
  ``apiVersion`` and the current ``resourceVersion``; ``labelSelector`` (=, ==, !=, in, notin,
  exists, !exists) and ``fieldSelector`` (metadata.name, metadata.namespace) filter lists and watches;
- watches: served as ``application/json`` lines; ``resourceVersion=N`` replays every event after
  N from the event log, without it the stream starts with the current objects taken atomically
  with the subscription; ``sendInitialEvents`` (with ``resourceVersionMatch=NotOlderThan``) ends the
  initial batch with the ``k8s.io/initial-events-end`` bookmark; ``timeoutSeconds`` (an integer)
  ends the stream;
- query parameters parsed as the real server parses them (``api_rules.py``: integer timeouts,
  unsigned resourceVersions, ``fieldValidation``/``dryRun`` values, selector syntax);
- discovery: core ``groupVersion`` is ``v1`` (kmock says ``/v1``); built-in kinds are declared up
  front and a created CustomResourceDefinition makes its resource discoverable (namespaced or
  not, short names, status subresource), as the real server does.

With ``upstream`` (``forwarding.Upstream``), the emulator serves only the built-in groups the real
CRD-serving server lacks (``EMULATED_GROUPS``) and forwards ``apiextensions.k8s.io`` and every other
group to it, as kube-apiserver's aggregator forwards to an extension server; ``/apis`` lists both.
Forwarded requests are recorded like served ones.

Not emulated: protobuf bodies (answered 415; ``kubectl create namespace`` sends protobuf, ``kubectl
apply`` sends JSON), schema validation or defaulting of custom resources when served here (no CEL, no
OpenAPI pruning: that is what the upstream is for), garbage collection by ownerReferences,
controllers (StatefulSets never get pods or status unless a test writes it), admission beyond the
namespace check, authorization (every request is allowed: see ``rbac_requests``), table output
(kubectl falls back to client-side printing), server-side apply field ownership and
``managedFields``, list pagination (``limit`` is ignored: every list is one page).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import random
import uuid
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import enums, rendering

from .api_rules import (
    APPLY_PATCH,
    PATCH_TYPES,
    STRATEGIC_MERGE,
    ApiError,
    already_exists,
    check_label_selector,
    check_metadata,
    check_watch_list,
    check_write_options,
    conflict,
    decode_body,
    field_selector_matches,
    label_selector_matches,
    merge_patch,
    namespace_not_found,
    not_found,
    parse_k8s_path,
    parse_resource_version,
    parse_timeout_seconds,
    qualified,
    read_body,
    request_action,
    sent_resource_version,
    strip_strategic_directives,
    unsupported_patch,
)
from .resources import (
    BUILTINS,
    CRDS,
    EMULATED_GROUPS,
    INITIAL_NAMESPACES,
    NAME_ALPHABET,
    NAMESPACES,
    STATUS_SUBRESOURCE,
    VERBS,
)

if TYPE_CHECKING:
    from .forwarding import Upstream


@attrs.frozen
class WatchEvent:
    revision: int
    resource: kmock.resource
    type: str
    object: dict[str, Any]


def _generation_relevant(obj: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _api_version(resource: kmock.resource) -> str:
    return f"{resource.group}/{resource.version}".lstrip("/")


@attrs.define(kw_only=True)
class ApiServerEmulator(kmock.KubernetesEmulator):
    """kmock's emulator completed for kopf and kubectl (see the module docstring for the list)."""

    upstream: Upstream | None = None
    _revision: int = attrs.field(default=0, init=False)
    _events: list[WatchEvent] = attrs.field(factory=list, init=False)
    _changed: asyncio.Condition = attrs.field(factory=asyncio.Condition, init=False)
    # Objects created through the API, per resource (kmock's store is one flat dict): lists stay cheap.
    _by_resource: dict[kmock.resource, dict[tuple[str | None, str], kmock.Object]] = attrs.field(
        factory=dict, init=False
    )
    # Resources served from a CustomResourceDefinition (the real server treats them differently).
    _custom: set[kmock.resource] = attrs.field(factory=set, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, kind, namespaced, subresources, shortnames in BUILTINS:
            if self.upstream is not None and kmock.resource(key).group not in EMULATED_GROUPS:
                continue  # the upstream serves it
            self.resources[key] = kmock.ResourceInfo(
                kind=kind,
                singular=kind.lower(),
                namespaced=namespaced,
                verbs=set(VERBS),
                subresources=set(subresources),
                shortnames=set(shortnames),
            )
        for name in INITIAL_NAMESPACES:
            namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
            self._store(NAMESPACES, None, name, self._stamped(namespace))

    # ---- requests: own parsing (kmock's parser breaks on /api/v1/namespaces), routing and forwarding

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        forwarded = self.upstream is not None and self.upstream.serves(raw_request.path)
        resource, namespace, name, subresource = parse_k8s_path(raw_request.path)
        if resource is None and not forwarded:
            return await super().__call__(raw_request)
        try:
            body = await read_body(raw_request)
        except ApiError as e:
            return e.response()
        content_type = raw_request.headers.get("Content-Type", "").split(";")[0].strip()
        method = enums.method(raw_request.method)
        params = dict(raw_request.query)
        request = rendering.Request(
            id=len(self._requests),
            raw_request=raw_request,
            url=raw_request.url,
            method=raw_request.method,
            params=params,
            headers=dict(raw_request.headers),
            data=decode_body(body, content_type),
            body=body,
            text=body.decode(errors="replace"),
            action=request_action(method, name, params),
            resource=resource,
            namespace=namespace,
            name=name,
            subresource=subresource,
        )
        self._requests.append(request)
        try:
            if forwarded and self.upstream is not None:
                if method == enums.method.POST and namespace is not None and name is None:
                    self._require_namespace(namespace)  # admission runs in front of every group
                return await self.upstream.forward(raw_request, body)
            if body and "protobuf" in content_type:
                raise ApiError(
                    415, "UnsupportedMediaType", "the emulator speaks JSON and YAML only, not protobuf"
                )
            if body and request.data is None:
                raise ApiError(
                    400, "BadRequest", f"error decoding the body: {request.text[:100]!r} is no JSON"
                )
            return await self._serve_resource(request, content_type)
        except ApiError as e:
            return e.response()

    async def _serve_resource(
        self, request: rendering.Request, content_type: str
    ) -> aiohttp.web.StreamResponse:
        assert request.resource is not None
        info = self._info(request.resource)
        if info is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        if request.subresource is not None and (
            request.subresource != STATUS_SUBRESOURCE or STATUS_SUBRESOURCE not in info.subresources
        ):
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        namespace = request.namespace if info.namespaced else None
        method = request.method
        check_write_options(method.value, request.params)
        if method == enums.method.GET and request.params.get("watch") in ("true", "1"):
            return await self._watch(request, info)
        if method == enums.method.GET and request.name is None:
            return aiohttp.web.json_response(await self._list(request, info))
        if method == enums.method.GET:
            return aiohttp.web.json_response(self._get(request.resource, namespace, request.name).raw)
        if method == enums.method.POST and request.name is None:
            return aiohttp.web.json_response(await self._create(request, info, namespace), status=201)
        if method in (enums.method.PATCH, enums.method.PUT) and request.name is not None:
            return aiohttp.web.json_response(await self._write(request, info, namespace, content_type))
        if method == enums.method.DELETE and request.name is not None:
            return aiohttp.web.json_response(await self._delete(request.resource, namespace, request.name))
        raise ApiError(405, "MethodNotAllowed", f"{method.value} is not supported on {request.url.path}")

    # ---- discovery

    def _info(self, resource: kmock.resource) -> kmock.ResourceInfo | None:
        # kmock answers an empty ResourceInfo for any resource it was never told of; a real server 404s.
        return self.resources.get(resource) if resource in self.resources else None

    async def _serve_apis(self, request: rendering.Request) -> rendering.Payload:
        payload = await super()._serve_apis(request)
        assert isinstance(payload, dict)
        if self.upstream is not None:  # one /apis for both servers, as the aggregator answers it
            payload["groups"] += await self.upstream.groups()
        return payload

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
            self._custom.add(key)
            self.resources[key] = kmock.ResourceInfo(
                kind=names["kind"],
                singular=names.get("singular", names["kind"].lower()),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                verbs=set(VERBS),
                subresources={"status"} if "status" in version.get("subresources", {}) else set(),
                shortnames=set(names.get("shortNames", [])),
                categories=set(names.get("categories", [])),
            )

    def _unregister_crd(self, crd: Mapping[str, Any]) -> None:
        spec = crd.get("spec", {})
        for version in spec.get("versions", []):
            key = kmock.resource(spec["group"], version["name"], spec["names"]["plural"])
            self._custom.discard(key)
            if key in self.resources:
                del self.resources[key]

    # ---- storage

    def _live(self, resource: kmock.resource, namespace: str | None, name: str) -> kmock.Object | None:
        key = (resource, namespace, name)
        if key in self.objects and not self.objects[key].deleted:
            return self.objects[key]
        return None

    def _get(self, resource: kmock.resource, namespace: str | None, name: str) -> kmock.Object:
        obj = self._live(resource, namespace, name)
        if obj is None:
            raise not_found(resource, name)
        return obj

    def _require_namespace(self, namespace: str) -> None:
        if self._live(NAMESPACES, None, namespace) is None:
            raise namespace_not_found(namespace)

    async def _emit(self, resource: kmock.resource, type_: str, obj: dict[str, Any]) -> None:
        self._events.append(WatchEvent(self._revision, resource, type_, obj))
        async with self._changed:
            self._changed.notify_all()

    def _next_revision(self) -> str:
        self._revision += 1
        return str(self._revision)

    def _stamped(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj["metadata"].update(
            uid=str(uuid.uuid4()),
            resourceVersion=self._next_revision(),
            generation=1,
            creationTimestamp=_now(),
        )
        return obj

    def _store(self, resource: kmock.resource, namespace: str | None, name: str, obj: dict[str, Any]) -> None:
        key = (resource, namespace, name)
        if key in self.objects:
            self.objects[key].create(obj)
        else:
            self.objects[key] = obj
            self._by_resource.setdefault(resource, {})[(namespace, name)] = self.objects[key]

    async def _create(
        self, request: rendering.Request, info: kmock.ResourceInfo, namespace: str | None
    ) -> dict[str, Any]:
        resource = request.resource
        assert resource is not None
        if not isinstance(request.data, dict):
            raise ApiError(400, "BadRequest", "the body of a create must be an object")
        obj = copy.deepcopy(request.data)
        if resource in self._custom and not (obj.get("apiVersion") and obj.get("kind")):
            # Custom resources decode as unstructured objects, which need their type (built-ins take it
            # from the URL).
            message = (
                f"the object provided is unrecognized (must be of type {info.kind}): Object 'Kind' is missing"
            )
            raise ApiError(400, "BadRequest", message)
        meta = obj.setdefault("metadata", {})
        if info.namespaced:
            if meta.get("namespace") and namespace and meta["namespace"] != namespace:
                message = (
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
                raise ApiError(400, "BadRequest", message)
            meta["namespace"] = namespace or meta.get("namespace") or "default"
            self._require_namespace(meta["namespace"])
        else:
            meta.pop("namespace", None)
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(random.choices(NAME_ALPHABET, k=5))
        check_metadata(str(info.kind), resource.group, resource.plural, obj)
        name = meta["name"]
        if STATUS_SUBRESOURCE in info.subresources:
            obj.pop("status", None)
        async with self._lock:
            if self._live(resource, meta.get("namespace"), name) is not None:
                raise already_exists(resource, name)
            if request.params.get("dryRun"):  # what would be stored, less the revision it never got
                meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=_now())
                return obj
            self._stamped(obj)
            self._store(resource, meta.get("namespace"), name, obj)
            if resource == CRDS:
                self._register_crd(obj)
            await self._emit(resource, "ADDED", obj)
        return obj

    async def _write(
        self, request: rendering.Request, info: kmock.ResourceInfo, namespace: str | None, content_type: str
    ) -> dict[str, Any]:
        resource, name = request.resource, request.name
        assert resource is not None and name is not None
        custom = resource in self._custom
        if request.method == enums.method.PATCH:
            if content_type not in PATCH_TYPES or (custom and content_type == STRATEGIC_MERGE):
                raise unsupported_patch(custom)
            if content_type == APPLY_PATCH and not request.params.get("fieldManager"):
                message = "Required value: is required for apply patch"
                raise ApiError(
                    422,
                    "Invalid",
                    f'PatchOptions.meta.k8s.io "" is invalid: fieldManager: {message}',
                    {"group": "meta.k8s.io", "kind": "PatchOptions"},
                )
        sent_version = sent_resource_version(request)
        if request.method == enums.method.PUT:
            self._check_update_body(request, custom, sent_version)
        async with self._lock:
            live = self._get(resource, namespace, name)
            old = copy.deepcopy(live.raw)
            new = self._patched(old, request, content_type)
            if sent_version and sent_version != old["metadata"].get("resourceVersion"):
                raise conflict(resource, name)
            new = self._restrict_to_scope(old, new, request.subresource, info)
            check_metadata(str(info.kind), resource.group, resource.plural, new)
            if new == old or request.params.get("dryRun"):
                return new
            if _generation_relevant(new) != _generation_relevant(old):
                new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
            new["metadata"]["resourceVersion"] = self._next_revision()
            key = (resource, namespace, name)
            meta = new["metadata"]
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                self.objects[key].delete()
                await self._emit(resource, "DELETED", new)
            else:
                self.objects[key].history.append(new)
                await self._emit(resource, "MODIFIED", new)
        return new

    @staticmethod
    def _check_update_body(request: rendering.Request, custom: bool, sent_version: str | None) -> None:
        if not isinstance(request.data, dict):
            raise ApiError(400, "BadRequest", "the body of an update must be an object")
        body_name = (request.data.get("metadata") or {}).get("name")
        if body_name != request.name:
            url_name = request.name
            message = (
                f"the name of the object ({body_name or ''}) does not match the name on the URL ({url_name})"
            )
            raise ApiError(400, "BadRequest", message)
        if custom and not sent_version:
            # Custom resources allow no unconditional update (built-ins such as ConfigMaps do).
            assert request.resource is not None
            message = "metadata.resourceVersion: Invalid value: 0: must be specified for an update"
            raise ApiError(
                422, "Invalid", f'{qualified(request.resource)} "{request.name}" is invalid: {message}'
            )

    @staticmethod
    def _patched(old: dict[str, Any], request: rendering.Request, content_type: str) -> dict[str, Any]:
        data = request.data
        if request.method == enums.method.PUT:
            assert isinstance(data, dict)
            return copy.deepcopy(data)
        if content_type == "application/json-patch+json":
            if not isinstance(data, list):
                raise ApiError(
                    400, "BadRequest", "error decoding patch: a JSON patch must be a list of operations"
                )
            try:
                return jsonpatch.apply_patch(old, data)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                # The real server says no more than this for a failed test or a missing path.
                message = "the server rejected our request due to an error in our request"
                raise ApiError(422, "Invalid", message, {}) from e
        if not isinstance(data, dict):
            raise ApiError(400, "BadRequest", "error decoding patch: a merge patch must be an object")
        if content_type == STRATEGIC_MERGE:
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
            "deletionGracePeriodSeconds",
            "generation",
            "resourceVersion",
        ):
            if field in old["metadata"]:
                meta[field] = old["metadata"][field]
            else:
                meta.pop(field, None)
        return result

    async def _delete(self, resource: kmock.resource, namespace: str | None, name: str) -> dict[str, Any]:
        async with self._lock:
            live = self._get(resource, namespace, name)
            obj = copy.deepcopy(live.raw)
            meta = obj["metadata"]
            if meta.get("finalizers"):
                if not meta.get("deletionTimestamp"):
                    # What the real server's registry does when finalizers hold an object: the deletion is
                    # immediate once they go, and controllers see a new generation.
                    meta["deletionTimestamp"] = _now()
                    meta["deletionGracePeriodSeconds"] = 0
                    meta["generation"] = meta.get("generation", 1) + 1
                    meta["resourceVersion"] = self._next_revision()
                    live.history.append(obj)
                    await self._emit(resource, "MODIFIED", obj)
                return obj
            meta["resourceVersion"] = self._next_revision()
            live.delete()
            if resource == CRDS:
                self._unregister_crd(obj)
            await self._emit(resource, "DELETED", obj)
        details = {"name": name, "group": resource.group, "kind": resource.plural, "uid": meta["uid"]}
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
        return body | {"details": {k: v for k, v in details.items() if v}}

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
        check_label_selector(request.params.get("labelSelector"))
        candidates = self._by_resource.get(request.resource, {})
        return [
            obj.raw
            for _, obj in sorted(candidates.items(), key=lambda item: (item[0][0] or "", item[0][1]))
            if not obj.deleted and self._matching(request, info, obj.raw)
        ]

    async def _list(self, request: rendering.Request, info: kmock.ResourceInfo) -> dict[str, Any]:
        assert request.resource is not None
        parse_resource_version(request.params.get("resourceVersion", ""), watch=False)
        async with self._lock:
            items = self._snapshot(request, info)
            revision = str(self._revision)
        return {
            "kind": f"{info.kind}List",
            "apiVersion": _api_version(request.resource),
            "metadata": {"resourceVersion": revision},
            "items": items,
        }

    async def _watch(
        self, request: rendering.Request, info: kmock.ResourceInfo
    ) -> aiohttp.web.StreamResponse:
        assert request.resource is not None and request._raw_request is not None
        params = request.params
        check_watch_list(params)
        timeout = parse_timeout_seconds(params)
        since = parse_resource_version(params.get("resourceVersion", ""), watch=True)
        initial_events = params.get("sendInitialEvents") == "true" or not since
        async with self._lock:
            if initial_events:
                backlog = [{"type": "ADDED", "object": obj} for obj in self._snapshot(request, info)]
                cursor = len(self._events)
            else:
                assert since is not None
                check_label_selector(params.get("labelSelector"))
                cursor = next(
                    (i for i, e in enumerate(self._events) if e.revision > since), len(self._events)
                )
                backlog = []
            revision = str(self._revision)
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        if params.get("sendInitialEvents") == "true" and params.get("allowWatchBookmarks") == "true":
            bookmark = {
                "kind": info.kind,
                "apiVersion": _api_version(request.resource),
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
            async with asyncio.timeout(timeout or None):
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
