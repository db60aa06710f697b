"""The real operator process against the real CRD-serving API server, through the emulator in front of
it (``tests/k8s/operator_env.py``): it starts, watches PDServices in all namespaces and in one, adds its
finalizer to what the real server stores and removes it on deletion, re-watches after the real server
restarts and after the server ends a watch (``--watch-timeout``: the integer ``timeoutSeconds`` round
trip), and exits cleanly on SIGTERM (``running_operator`` asserts exit code 0 and no handler exception
after every test).

One world serves the module; each test runs its own operator and keeps to its own namespaces.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from tests.k8s.harness import Kubectl, eventually, is_operator_request
from tests.k8s.operator_env import PDSERVICES_DISCOVERY, one_world, running_operator
from tests.k8s.real_server import RealApiServer
from tests.k8s.server import EmulatedCluster

REPO = pathlib.Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "tiny-cpu.yaml"
FINALIZER = "inference.pdoperator.dev/finalizer"
NAMESPACES = ("all-a", "all-b", "scoped", "unwatched", "restart", "expiry", "stop")


@dataclass
class World:
    real: RealApiServer
    cluster: EmulatedCluster
    kubectl: Kubectl
    workdir: pathlib.Path

    def stored(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The PDService as the real server stores it (None once it is gone)."""
        path = f"{PDSERVICES_DISCOVERY}/namespaces/{namespace}/pdservices/{name}"
        code, obj, _ = self.real.request("GET", path)
        assert code in (200, 404), obj
        return obj if code == 200 else None

    def finalized(self, namespace: str, name: str) -> bool:
        obj = self.stored(namespace, name)
        return obj is not None and FINALIZER in (obj["metadata"].get("finalizers") or [])

    def create(self, namespace: str, name: str) -> None:
        manifest = yaml.safe_load(EXAMPLE.read_text())
        manifest["metadata"] = {"name": name, "namespace": namespace}
        self.kubectl.apply(yaml.safe_dump(manifest))

    def pdservice_watches(self, since: int = 0) -> list[tuple[str, dict[str, str]]]:
        """Path and query parameters of every PDService watch the operator opened."""
        return [
            (r.url.path, r.params)
            for r in self.cluster.requests()[since:]
            if is_operator_request(r)
            and r.params.get("watch") == "true"
            and r.url.path.endswith("/pdservices")
        ]

    def operator(self, name: str, *args: str) -> Any:
        return running_operator(self.cluster, self.kubectl, self.workdir / f"{name}.log", args)


@pytest.fixture(scope="module")
def world(kubectl: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    workdir = tmp_path_factory.mktemp("operator-real")
    with one_world(kubectl, workdir, NAMESPACES) as (real, cluster, cli):
        yield World(real, cluster, cli, workdir)


def test_watching_all_namespaces_it_finalizes_what_the_real_server_stores_and_releases_it_on_delete(
    world: World,
) -> None:
    mark = len(world.cluster.requests())
    with world.operator("all", "-A"):
        world.create("all-a", "one")
        world.create("all-b", "two")
        eventually(lambda: world.finalized("all-a", "one"), "the finalizer on all-a/one")
        eventually(lambda: world.finalized("all-b", "two"), "the finalizer on all-b/two")
        eventually(lambda: world.cluster.get("apps/v1/statefulsets", "all-a", "one-decode"), "a child")
        world.kubectl.run("delete", "pds", "one", "-n", "all-a", "--wait=false")
        eventually(lambda: world.stored("all-a", "one") is None, "all-a/one gone from the real server")
        eventually(
            lambda: world.cluster.get("apps/v1/statefulsets", "all-a", "one-decode") is None, "children gone"
        )
        assert world.finalized("all-b", "two")
    assert {path for path, _ in world.pdservice_watches(mark)} == {f"{PDSERVICES_DISCOVERY}/pdservices"}


def test_watching_one_namespace_it_leaves_the_others_alone(world: World) -> None:
    mark = len(world.cluster.requests())
    with world.operator("scoped", "--namespace", "scoped"):
        world.create("unwatched", "outside")
        world.create("scoped", "inside")
        eventually(lambda: world.finalized("scoped", "inside"), "the finalizer on scoped/inside")
        time.sleep(1)
        assert not world.finalized("unwatched", "outside")
    paths = {
        r.url.path
        for r in world.cluster.requests()[mark:]
        if is_operator_request(r) and r.params.get("watch")
    }
    assert f"{PDSERVICES_DISCOVERY}/namespaces/scoped/pdservices" in paths
    assert not any(p.endswith("/pdservices") and "/namespaces/scoped/" not in p for p in paths)


def test_it_watches_again_after_the_real_server_restarts_and_reconciles_what_comes_after(
    world: World,
) -> None:
    with world.operator("restart", "-A"):
        mark = len(world.cluster.requests())
        world.real.restart()
        eventually(
            lambda: world.pdservice_watches(mark), "a new PDService watch after the restart", timeout=60
        )
        world.create("restart", "after")
        eventually(lambda: world.finalized("restart", "after"), "the finalizer after the restart", timeout=60)
        eventually(lambda: world.cluster.get("apps/v1/statefulsets", "restart", "after-decode"), "a child")


def test_it_renews_a_watch_the_server_ends_and_handles_changes_after_it(world: World) -> None:
    mark = len(world.cluster.requests())
    with world.operator("expiry", "-A", "--watch-timeout", "2"):
        # the server ends each 2 s watch; the operator must open the next one itself
        watches = eventually(
            lambda: (w := world.pdservice_watches(mark)) and len(w) >= 3 and w, "three PDService watches", 15
        )
        assert all(params["timeoutSeconds"] == "2" for _, params in watches)
        world.create("expiry", "late")
        eventually(lambda: world.finalized("expiry", "late"), "the finalizer after the watch expired")


def test_sigterm_stops_it_cleanly_and_promptly(world: World) -> None:
    with world.operator("stop", "-A") as operator:
        world.create("stop", "held")
        eventually(lambda: world.finalized("stop", "held"), "the finalizer on stop/held")
        started = time.monotonic()
        code = operator.stop()
        assert (code, operator.running) == (0, False)
        assert time.monotonic() - started < 10
    log = operator.log()
    assert "Signal SIGTERM is received" in log and "Traceback" not in log
