"""The emulator against the real API server: the same cases, run on both, for a custom resource both serve.

Every test takes ``api``, parametrized over the emulator serving the CRD by itself and the real CRD-serving
server (``pd-apiserver``, Kubernetes 1.36 code) serving the same CRD, and asserts one expected behaviour for
both: where the emulator answers differently from Kubernetes, a test here fails and says where.

Where they legitimately differ, it is written here and nowhere else (``Api.comparable`` drops it):
- ``metadata.managedFields``: the real server records field ownership for server-side apply; the emulator
  applies apply patches as merge patches and keeps no ownership.
- Namespaces: the real server has no Namespace API and no admission (see ``tests/k8s/apiserver/main.go``), so
  it takes objects in any namespace; the emulator, like a full kube-apiserver, needs the Namespace first. The
  fixture creates it on the emulator.
- A path no resource serves: the real server's handler chain ends in Go's plain-text ``404 page not found``,
  kube-apiserver's (and the emulator's) in a ``NotFound`` Status; ``forwarding.py`` answers the latter for it.
- Values: uids, timestamps and resourceVersions differ, their forms do not.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.k8s.harness import eventually
from tests.k8s.real_server import RealApiServer
from tests.k8s.server import EmulatedCluster

GROUP = "conformance.example.com"
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"widgets.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"kind": "Widget", "plural": "widgets", "singular": "widget", "listKind": "WidgetList"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}
NAMESPACE = "conformance"
WIDGETS = f"/apis/{GROUP}/v1/namespaces/{NAMESPACE}/widgets"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class Api:
    """A plain HTTP client for either backend: ``(code, decoded body)`` per request, failures included."""

    def __init__(self, name: str, url: str, token: str, context: ssl.SSLContext | None) -> None:
        self.name, self.url, self.token, self.context = name, url, token, context

    def __repr__(self) -> str:
        return self.name

    def __call__(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        url = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        data = body.encode() if isinstance(body, str) else None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": content_type}
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30, context=self.context) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw or b"null")
            except ValueError:
                return e.code, raw.decode(errors="replace")

    def watch(self, params: dict[str, str], path: str = WIDGETS) -> tuple[float, list[dict[str, Any]]]:
        """A watch read to its end: ``(seconds it stayed open, events)``."""
        started = time.monotonic()
        code, events = self.stream(path, {"watch": "true", **params})
        assert code == 200, events
        return time.monotonic() - started, events

    def stream(self, path: str, params: dict[str, str]) -> tuple[int, list[dict[str, Any]]]:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(request, timeout=30, context=self.context) as response:
                return response.status, [json.loads(line) for line in response.read().splitlines() if line]
        except urllib.error.HTTPError as e:
            return e.code, [json.loads(e.read())]

    def create(self, name: str, **fields: Any) -> dict[str, Any]:
        code, obj = self("POST", WIDGETS, widget(name, **fields))
        assert code == 201, obj
        return comparable(obj)


def widget(name: str, **fields: Any) -> dict[str, Any]:
    meta = {"name": name, **fields.pop("metadata", {})}
    return {"apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": meta, **fields}


def comparable(obj: Any) -> Any:
    """The object less what legitimately differs (the module docstring)."""
    if isinstance(obj, dict) and isinstance(obj.get("metadata"), dict):
        obj["metadata"].pop("managedFields", None)
    return obj


@pytest.fixture(scope="module", params=["emulator", "real"])
def api(request: pytest.FixtureRequest, real_apiserver: RealApiServer) -> Iterator[Api]:
    if request.param == "real":
        context = ssl.create_default_context(cafile=str(real_apiserver.certificate))
        context.check_hostname = False
        yield install(Api("real", real_apiserver.url, real_apiserver.token, context))
        return
    with EmulatedCluster() as cluster:
        api = Api("emulator", cluster.url, "emulated", None)
        assert api("POST", "/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})[0] == 201
        yield install(api)


def install(api: Api) -> Api:
    code, answer = api("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", CRD)
    assert code in (201, 409), answer
    eventually(lambda: api("GET", f"/apis/{GROUP}/v1")[0] == 200, "the CRD served")
    return api


# ---------------------------------------------------------------- create and read


def test_create_fills_server_metadata_and_drops_status(api: Api) -> None:
    obj = api.create("meta", spec={"size": 1}, status={"ignored": True})
    meta = obj["metadata"]
    assert set(meta) == {"name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp"}
    assert meta["generation"] == 1 and meta["resourceVersion"].isdigit() and meta["uid"]
    assert time.strptime(meta["creationTimestamp"], "%Y-%m-%dT%H:%M:%SZ")
    assert "status" not in obj and obj["spec"] == {"size": 1}
    assert comparable(api("GET", f"{WIDGETS}/meta")[1]) == obj


def test_create_errors(api: Api) -> None:
    api.create("dup")
    code, status = api("POST", WIDGETS, widget("dup"))
    assert (code, status) == (
        409,
        {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f'widgets.{GROUP} "dup" already exists',
            "reason": "AlreadyExists",
            "details": {"name": "dup", "group": GROUP, "kind": "widgets"},
            "code": 409,
        },
    )
    code, status = api("POST", WIDGETS, {"metadata": {"name": "untyped"}})
    assert (code, status["reason"]) == (400, "BadRequest")
    assert "Object 'Kind' is missing" in status["message"]
    code, status = api("POST", WIDGETS, widget("elsewhere", metadata={"namespace": "other"}))
    assert (code, status["message"]) == (
        400,
        "the namespace of the provided object does not match the namespace sent on the request",
    )


@pytest.mark.parametrize(
    ("metadata", "field", "message"),
    [
        ({"name": "Bad_Name"}, "metadata.name", 'Invalid value: "Bad_Name": a lowercase RFC 1123 subdomain'),
        ({"name": ""}, "metadata.name", "Required value: name or generateName is required"),
        ({"name": "x" * 254}, "metadata.name", "must be no more than 253 characters"),
        ({"name": "lab", "labels": {"a": "x" * 64}}, "metadata.labels", "must be no more than 63 bytes"),
    ],
)
def test_invalid_metadata_is_422_naming_the_field(
    api: Api, metadata: dict[str, Any], field: str, message: str
) -> None:
    body = widget("", metadata=metadata)
    code, status = api("POST", WIDGETS, body)
    assert (code, status["reason"], status["details"]["kind"]) == (422, "Invalid", "Widget")
    assert status["message"].startswith(f'Widget.{GROUP} "{metadata["name"]}" is invalid: {field}: ')
    assert message in status["message"]
    assert status["details"]["causes"][0]["field"] == field


def test_a_missing_object_is_a_404_status(api: Api) -> None:
    expected = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f'widgets.{GROUP} "nope" not found',
        "reason": "NotFound",
        "details": {"name": "nope", "group": GROUP, "kind": "widgets"},
        "code": 404,
    }
    assert api("GET", f"{WIDGETS}/nope") == (404, expected)
    assert api("PATCH", f"{WIDGETS}/nope", {"spec": {}}, MERGE) == (404, expected)
    assert api("DELETE", f"{WIDGETS}/nope") == (404, expected)
    assert api("GET", f"/apis/{GROUP}/v1/namespaces/{NAMESPACE}/gadgets")[0] == 404  # body: see the docstring


def test_write_options_take_only_their_values_and_dry_run_stores_nothing(api: Api) -> None:
    code, status = api("POST", WIDGETS, widget("fv"), params={"fieldValidation": "Bogus"})
    assert (code, status["reason"], status["details"]["kind"]) == (422, "Invalid", "CreateOptions")
    assert 'fieldValidation: Unsupported value: "Bogus"' in status["message"]
    code, status = api("POST", WIDGETS, widget("dr"), params={"dryRun": "Yes"})
    assert (code, status["reason"]) == (422, "Invalid") and "dryRun: Unsupported value" in status["message"]
    code, obj = api("POST", WIDGETS, widget("dr"), params={"dryRun": "All"})
    assert code == 201 and obj["metadata"]["uid"] and "resourceVersion" not in obj["metadata"]
    assert api("GET", f"{WIDGETS}/dr")[0] == 404


# ---------------------------------------------------------------- writes


def test_merge_and_json_patches_and_the_types_custom_resources_refuse(api: Api) -> None:
    api.create("p", spec={"a": 1, "b": {"c": 2}})
    code, obj = api("PATCH", f"{WIDGETS}/p", {"spec": {"b": None, "d": [1]}}, MERGE)
    assert (code, obj["spec"]) == (200, {"a": 1, "d": [1]})
    ops = [{"op": "add", "path": "/spec/d/-", "value": 2}, {"op": "remove", "path": "/spec/a"}]
    code, obj = api("PATCH", f"{WIDGETS}/p", ops, JSON_PATCH)
    assert (code, obj["spec"]) == (200, {"d": [1, 2]})
    accepted = "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml"
    for content_type in ("application/strategic-merge-patch+json", "application/bogus"):
        code, status = api("PATCH", f"{WIDGETS}/p", {"spec": {}}, content_type)
        assert (code, status["reason"], status["message"]) == (
            415,
            "UnsupportedMediaType",
            f"the body of the request was in an unknown format - accepted media types include: {accepted}",
        )
    code, status = api("PATCH", f"{WIDGETS}/p", widget("p"), "application/apply-patch+yaml")
    assert (code, status["reason"]) == (422, "Invalid") and "fieldManager: Required value" in status[
        "message"
    ]
    code, status = api("PATCH", f"{WIDGETS}/p", "{not json", MERGE)
    assert (code, status["reason"]) == (400, "BadRequest")


def test_a_failed_json_patch_test_is_422_and_changes_nothing(api: Api) -> None:
    before = api.create("jp", spec={"a": 1})
    ops = [{"op": "test", "path": "/spec/a", "value": 2}, {"op": "replace", "path": "/spec/a", "value": 3}]
    code, status = api("PATCH", f"{WIDGETS}/jp", ops, JSON_PATCH)
    assert (code, status["reason"], status["message"]) == (
        422,
        "Invalid",
        "the server rejected our request due to an error in our request",
    )
    assert comparable(api("GET", f"{WIDGETS}/jp")[1]) == before


def test_resource_version_conflicts(api: Api) -> None:
    obj = api.create("rv", spec={"a": 1})
    stale = str(int(obj["metadata"]["resourceVersion"]) - 1)
    code, status = api(
        "PATCH", f"{WIDGETS}/rv", {"metadata": {"resourceVersion": stale}, "spec": {"a": 2}}, MERGE
    )
    assert (code, status["reason"], status["details"]) == (
        409,
        "Conflict",
        {"name": "rv", "group": GROUP, "kind": "widgets"},
    )
    assert status["message"] == (
        f'Operation cannot be fulfilled on widgets.{GROUP} "rv": the object has been modified; '
        "please apply your changes to the latest version and try again"
    )
    code, status = api("PATCH", f"{WIDGETS}/rv", {"metadata": {"resourceVersion": "abc"}}, MERGE)
    assert (code, status["message"]) == (500, 'strconv.ParseUint: parsing "abc": invalid syntax')
    current = obj["metadata"]["resourceVersion"]
    code, patched = api(
        "PATCH", f"{WIDGETS}/rv", {"metadata": {"resourceVersion": current}, "spec": {"a": 2}}, MERGE
    )
    assert (code, patched["spec"]) == (200, {"a": 2})


def test_updates_need_the_resource_version_and_the_url_name(api: Api) -> None:
    obj = api.create("put", spec={"a": 1})
    code, status = api("PUT", f"{WIDGETS}/put", widget("put", spec={"a": 2}))
    assert (code, status["reason"]) == (422, "Invalid")
    assert "metadata.resourceVersion: Invalid value: 0: must be specified for an update" in status["message"]
    code, status = api("PUT", f"{WIDGETS}/put", widget("other", spec={"a": 2}))
    assert (code, status["message"]) == (
        400,
        "the name of the object (other) does not match the name on the URL (put)",
    )
    version = {"resourceVersion": obj["metadata"]["resourceVersion"]}
    code, updated = api("PUT", f"{WIDGETS}/put", widget("put", metadata=version, spec={"b": 1}))
    assert (code, updated["spec"], updated["metadata"]["generation"]) == (200, {"b": 1}, 2)


def test_status_is_its_own_subresource_and_only_spec_bumps_the_generation(api: Api) -> None:
    api.create("st", spec={"size": 1})
    code, obj = api("PATCH", f"{WIDGETS}/st/status", {"spec": {"size": 9}, "status": {"ok": True}}, MERGE)
    assert (code, obj["spec"], obj["status"], obj["metadata"]["generation"]) == (
        200,
        {"size": 1},
        {"ok": True},
        1,
    )
    code, obj = api("PATCH", f"{WIDGETS}/st", {"spec": {"size": 2}, "status": {"ok": False}}, MERGE)
    assert (obj["spec"], obj["status"], obj["metadata"]["generation"]) == ({"size": 2}, {"ok": True}, 2)
    code, obj = api("PATCH", f"{WIDGETS}/st", {"metadata": {"labels": {"l": "v"}}}, MERGE)
    assert (obj["metadata"]["labels"], obj["metadata"]["generation"]) == ({"l": "v"}, 2)
    unchanged = api("PATCH", f"{WIDGETS}/st", {"spec": {"size": 2}}, MERGE)[1]
    assert unchanged["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]


def test_finalizers_hold_the_deletion_until_the_last_one_goes(api: Api) -> None:
    api.create("fin", metadata={"finalizers": ["example.com/a", "example.com/b"]})
    code, marked = api("DELETE", f"{WIDGETS}/fin")
    meta = marked["metadata"]
    assert code == 200 and meta["deletionTimestamp"] and meta["deletionGracePeriodSeconds"] == 0
    assert meta["generation"] == 2  # deletion starting is a change controllers must see
    again = api("DELETE", f"{WIDGETS}/fin")[1]
    assert again["metadata"]["resourceVersion"] == meta["resourceVersion"]
    code, obj = api("PATCH", f"{WIDGETS}/fin", {"metadata": {"finalizers": ["example.com/b"]}}, MERGE)
    assert code == 200 and api("GET", f"{WIDGETS}/fin")[0] == 200
    code, obj = api("PATCH", f"{WIDGETS}/fin", {"metadata": {"finalizers": None}}, MERGE)
    assert code == 200 and obj["metadata"]["deletionTimestamp"] and "finalizers" not in obj["metadata"]
    assert api("GET", f"{WIDGETS}/fin")[0] == 404


def test_an_immediate_deletion_answers_a_success_status(api: Api) -> None:
    uid = api.create("del")["metadata"]["uid"]
    code, status = api("DELETE", f"{WIDGETS}/del")
    assert (code, status) == (
        200,
        {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": {"name": "del", "group": GROUP, "kind": "widgets", "uid": uid},
        },
    )


# ---------------------------------------------------------------- lists and watches


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("tier=web", ["sel-a", "sel-b"]),
        ("tier==web,zone", ["sel-a"]),
        ("tier!=web", ["sel-c"]),
        ("tier in (db, cache)", ["sel-c"]),
        ("tier notin (web)", ["sel-c"]),
        ("!zone,tier", ["sel-b", "sel-c"]),
    ],
)
def test_label_selectors(api: Api, selector: str, expected: list[str]) -> None:
    labelled = {"sel-a": {"tier": "web", "zone": "a"}, "sel-b": {"tier": "web"}, "sel-c": {"tier": "db"}}
    for name, labels in labelled.items():
        if api("GET", f"{WIDGETS}/{name}")[0] == 404:
            api.create(name, metadata={"labels": {"set": "sel", **labels}})
    # Every term also matches objects without the label, so the objects of this test are picked first.
    code, listing = api("GET", WIDGETS, params={"labelSelector": f"set=sel,{selector}"})
    assert code == 200 and [o["metadata"]["name"] for o in listing["items"]] == expected


def test_lists_and_their_selectors(api: Api) -> None:
    api.create("list-b")
    api.create("list-a")
    code, listing = api("GET", WIDGETS, params={"fieldSelector": "metadata.name=list-a"})
    assert (listing["kind"], listing["apiVersion"]) == ("WidgetList", f"{GROUP}/v1")
    assert listing["metadata"]["resourceVersion"].isdigit()
    assert [o["metadata"]["name"] for o in listing["items"]] == ["list-a"]
    names = [o["metadata"]["name"] for o in api("GET", WIDGETS)[1]["items"]]
    assert names == sorted(names)  # etcd's key order
    code, status = api("GET", WIDGETS, params={"fieldSelector": "spec.size=1"})
    assert (code, status["reason"], status["message"]) == (
        400,
        "BadRequest",
        "field label not supported: spec.size",
    )
    assert api("GET", WIDGETS, params={"labelSelector": "a b c"})[0] == 400
    code, status = api("GET", WIDGETS, params={"resourceVersion": "abc"})
    assert (code, status["reason"]) == (400, "BadRequest")
    assert status["message"] == (
        'invalid resource version: resourceVersion: Invalid value: "abc": strconv.ParseUint: parsing "abc": '
        "invalid syntax"
    )


def test_a_watch_replays_from_a_resource_version_and_ends_after_timeout_seconds(api: Api) -> None:
    since = api("GET", WIDGETS)[1]["metadata"]["resourceVersion"]
    api.create("w1", metadata={"labels": {"w": "yes"}})
    api.create("w2")
    api("PATCH", f"{WIDGETS}/w1", {"spec": {"x": 1}}, MERGE)
    api("DELETE", f"{WIDGETS}/w1")
    seconds, events = api.watch({"resourceVersion": since, "timeoutSeconds": "1", "labelSelector": "w=yes"})
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "w1"),
        ("MODIFIED", "w1"),
        ("DELETED", "w1"),
    ]
    assert 0.9 < seconds < 5


def test_a_watch_streams_what_happens_while_it_is_open(api: Api) -> None:
    since = api("GET", WIDGETS)[1]["metadata"]["resourceVersion"]
    received: list[dict[str, Any]] = []
    watcher = threading.Thread(
        target=lambda: received.extend(api.watch({"resourceVersion": since, "timeoutSeconds": "2"})[1])
    )
    watcher.start()
    time.sleep(0.5)
    api.create("live")
    watcher.join(10)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in received] == [("ADDED", "live")]


def test_initial_events_end_with_a_bookmark(api: Api) -> None:
    api.create("initial", metadata={"labels": {"batch": "initial"}})
    params = {"sendInitialEvents": "true", "allowWatchBookmarks": "true", "timeoutSeconds": "1"}
    params["labelSelector"] = "batch=initial"
    code, status = api.stream(WIDGETS, {"watch": "true", **params})
    assert (code, status[0]["reason"]) == (422, "Invalid")
    assert "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan" in status[0]["message"]
    _, events = api.watch({**params, "resourceVersionMatch": "NotOlderThan"})
    assert [e["type"] for e in events] == ["ADDED", "BOOKMARK"]
    bookmark = events[1]["object"]
    assert (bookmark["kind"], bookmark["apiVersion"]) == ("Widget", f"{GROUP}/v1")
    assert bookmark["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert bookmark["metadata"]["resourceVersion"].isdigit()


@pytest.mark.parametrize(
    ("params", "code", "message"),
    [
        ({"timeoutSeconds": "1.5"}, 400, 'strconv.ParseInt: parsing "1.5": invalid syntax'),
        ({"timeoutSeconds": "300.0"}, 400, 'strconv.ParseInt: parsing "300.0": invalid syntax'),
        (
            {"resourceVersion": "abc"},
            500,
            'resourceVersion: Invalid value: "abc": strconv.ParseUint: parsing "abc": invalid syntax',
        ),
    ],
)
def test_watch_parameters_parse_as_the_real_server_parses_them(
    api: Api, params: dict[str, str], code: int, message: str
) -> None:
    answer, body = api.stream(WIDGETS, {"watch": "true", **params})
    assert (answer, body[0]["message"]) == (code, message)
