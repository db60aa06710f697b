"""The one world: the emulator in front of the real CRD-serving server, as kube-apiserver's aggregator is in
front of an extension server (``forwarding.py``)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.k8s.harness import eventually
from tests.k8s.real_server import RealApiServer
from tests.k8s.server import EmulatedCluster, call

GROUP = "forwarding.example.com"
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"gizmos.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"kind": "Gizmo", "plural": "gizmos"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {"size": {"type": "integer", "default": 3, "maximum": 10}},
                            }
                        },
                    }
                },
            }
        ],
    },
}
GIZMOS = f"/apis/{GROUP}/v1/namespaces/front/gizmos"


@pytest.fixture(scope="module")
def cluster(real_apiserver: RealApiServer) -> Iterator[EmulatedCluster]:
    with EmulatedCluster(upstream=real_apiserver) as front:
        assert call(front, "POST", "/api/v1/namespaces", {"metadata": {"name": "front"}})[0] == 201
        code, answer = call(front, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", CRD)
        assert code == 201, answer
        eventually(lambda: call(front, "GET", f"/apis/{GROUP}/v1")[0] == 200, "the CRD served")
        yield front


def test_apis_lists_the_emulated_groups_and_the_real_servers(cluster: EmulatedCluster) -> None:
    groups = {g["name"] for g in call(cluster, "GET", "/apis")[1]["groups"]}
    assert {"apps", "policy", "networking.k8s.io", "apiextensions.k8s.io", GROUP} <= groups
    assert cluster.emulator is not None and cluster.emulator.upstream is not None
    assert (
        call(cluster, "GET", "/apis/apiextensions.k8s.io/v1")[1]["groupVersion"] == "apiextensions.k8s.io/v1"
    )


def test_custom_resources_are_validated_defaulted_and_stored_by_the_real_server(
    cluster: EmulatedCluster,
) -> None:
    gizmo = {"apiVersion": f"{GROUP}/v1", "kind": "Gizmo", "metadata": {"name": "g"}, "spec": {}}
    code, created = call(cluster, "POST", GIZMOS, gizmo)
    assert (code, created["spec"]) == (201, {"size": 3})  # the schema's default
    assert cluster.get(f"{GROUP}/v1/gizmos", "front", "g") == created
    assert [o["metadata"]["name"] for o in cluster.objects(f"{GROUP}/v1/gizmos")] == ["g"]
    code, status = call(
        cluster, "PATCH", f"{GIZMOS}/g", {"spec": {"size": 11}}, "application/merge-patch+json"
    )
    assert (code, status["reason"]) == (422, "Invalid") and "spec.size" in status["message"]
    recorded = [r for r in cluster.requests() if r.method.value == "PATCH" and r.url.path == f"{GIZMOS}/g"]
    assert recorded and recorded[-1].data == {"spec": {"size": 11}} and recorded[-1].name == "g"


def test_creates_need_the_namespace_on_every_group(cluster: EmulatedCluster) -> None:
    gizmo = {"apiVersion": f"{GROUP}/v1", "kind": "Gizmo", "metadata": {"name": "g"}}
    code, status = call(cluster, "POST", f"/apis/{GROUP}/v1/namespaces/nowhere/gizmos", gizmo)
    assert (code, status["message"]) == (404, 'namespaces "nowhere" not found')


def test_a_missing_crd_group_is_a_not_found_status(cluster: EmulatedCluster) -> None:
    code, status = call(cluster, "GET", "/apis/absent.example.com/v1/namespaces/front/things")
    assert (code, status["kind"], status["reason"]) == (404, "Status", "NotFound")


def test_a_watch_streams_through_the_front_and_ends_at_its_timeout(cluster: EmulatedCluster) -> None:
    since = call(cluster, "GET", GIZMOS)[1]["metadata"]["resourceVersion"]
    received: list[dict[str, Any]] = []
    ended: list[float] = []

    def watch() -> None:
        started = time.monotonic()
        url = f"{cluster.url}{GIZMOS}?watch=true&resourceVersion={since}&timeoutSeconds=2"
        with urllib.request.urlopen(url, timeout=10) as response:
            for line in response:
                received.append(json.loads(line))
        ended.append(time.monotonic() - started)

    watcher = threading.Thread(target=watch)
    watcher.start()
    time.sleep(0.5)
    gizmo = {"apiVersion": f"{GROUP}/v1", "kind": "Gizmo", "metadata": {"name": "streamed"}}
    assert call(cluster, "POST", GIZMOS, gizmo)[0] == 201
    eventually(lambda: received, "the event through the open watch", timeout=5)
    watcher.join(10)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in received] == [("ADDED", "streamed")]
    assert ended and 1.9 < ended[0] < 5
    code, status = call(cluster, "GET", f"{GIZMOS}?watch=true&timeoutSeconds=300.0")
    assert (code, status["message"]) == (400, 'strconv.ParseInt: parsing "300.0": invalid syntax')
