"""Operator benchmark against the API emulator (kmock 0.8 + tests/k8s): the real operator process.

Measures, and prints:
  1. latency from creating a PDService to all its rendered children existing (p50/p99), one at a time;
  2. API writes per PDService until it is settled (by kind of write), and writes while idle;
  3. total time to reconcile N PDServices created at once (children created + status written).

    .venv/bin/python e2e/bench/operator_bench.py [--sequential 30] [--burst 200] [--real-apiserver]

The emulator is a single-threaded Python server: absolute numbers are the emulator's as much as
the operator's, so compare runs on the same machine. With ``--real-apiserver`` the PDServices live on the
real CRD-serving API server behind the emulator (the tests' one world: ``tests/k8s/operator_env.py``), so
their validation, defaulting and storage are Kubernetes' own.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the emulator lives with the tests

from pdoperator.api import crd_manifest, parse_pdservice  # noqa: E402
from pdoperator.render import RenderDefaults, render_pdservice  # noqa: E402

from tests.k8s.harness import OperatorProcess, eventually, is_operator_request, writes_by_operator  # noqa: E402
from tests.k8s.real_server import RealApiServer  # noqa: E402
from tests.k8s.server import EmulatedCluster  # noqa: E402

PDS_PATH = "/apis/inference.pdoperator.dev/v1alpha1/namespaces/{namespace}/pdservices"
CHILD_RESOURCES = (
    "apps/v1/statefulsets",
    "apps/v1/deployments",
    "v1/services",
    "v1/configmaps",
    "networking.k8s.io/v1/networkpolicies",
    "policy/v1/poddisruptionbudgets",
)


def post(cluster: EmulatedCluster, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        cluster.url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def served(cluster: EmulatedCluster, path: str) -> bool:
    try:
        with urllib.request.urlopen(cluster.url + path, timeout=10) as response:
            return response.status == 200
    except OSError:
        return False


def pdservice(name: str, namespace: str) -> dict[str, Any]:
    manifest = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    manifest["metadata"] = {"name": name, "namespace": namespace}
    return manifest


def children_by_instance(cluster: EmulatedCluster, namespace: str) -> collections.Counter[str]:
    emulator = cluster.emulator
    assert emulator is not None

    def count() -> collections.Counter[str]:
        found: collections.Counter[str] = collections.Counter()
        for resource in CHILD_RESOURCES:
            for obj in emulator.live_objects(resource):
                meta = obj["metadata"]
                if meta.get("namespace") == namespace:
                    found[(meta.get("labels") or {}).get("app.kubernetes.io/instance", "")] += 1
        return found

    return cluster.call(count)


def statuses_written(cluster: EmulatedCluster, namespace: str) -> int:
    return sum(
        1
        for obj in cluster.objects("inference.pdoperator.dev/v1alpha1/pdservices")
        if obj["metadata"]["namespace"] == namespace and (obj.get("status") or {}).get("observedGeneration")
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def classify(write: str) -> str:
    method, path = write.split(" ", 1)
    if path.endswith("/events"):
        return "event"
    if "/pdservices/" in path:
        return "pdservice status" if path.endswith("/status") else "pdservice (kopf finalizer/annotations)"
    return f"child {method.lower()}"


@contextlib.contextmanager
def world(tmp: pathlib.Path, real_apiserver: bool) -> Iterator[EmulatedCluster]:
    """The emulator, in front of a real API server when asked, with the namespaces and the CRD."""
    with contextlib.ExitStack() as stack:
        real = stack.enter_context(RealApiServer(tmp / "apiserver")) if real_apiserver else None
        cluster = stack.enter_context(EmulatedCluster(upstream=real))
        for namespace in ("seq", "burst"):  # a namespace exists before anything is created in it
            namespace_object = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
            post(cluster, "/api/v1/namespaces", namespace_object)
        post(cluster, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd_manifest())
        eventually(lambda: served(cluster, PDS_PATH.format(namespace="seq")), "the PDService CRD served", 30)
        yield cluster


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sequential", type=int, default=30, help="PDServices created one at a time (latency)"
    )
    parser.add_argument("--burst", type=int, default=200, help="PDServices created at once (throughput)")
    parser.add_argument(
        "--real-apiserver", action="store_true", help="PDServices on the real API server behind the emulator"
    )
    args = parser.parse_args()
    expected = len(render_pdservice(parse_pdservice(pdservice("x", "default")), RenderDefaults()))

    with tempfile.TemporaryDirectory() as tmp, world(pathlib.Path(tmp), args.real_apiserver) as cluster:
        kubeconfig = cluster.write_kubeconfig(pathlib.Path(tmp) / "kubeconfig")
        operator = OperatorProcess(
            kubeconfig,
            pathlib.Path(tmp) / "operator.log",
            ["-A", "--kv-check-interval", "3600", "--log-format", "plain"],
        )
        os.environ.pop("KUBERNETES_SERVICE_HOST", None)
        operator.start()
        try:
            eventually(
                lambda: any(
                    is_operator_request(r) and r.params.get("watch") == "true" for r in cluster.requests()
                ),
                "operator watches",
                60,
            )
            time.sleep(1)

            # 1 + 2: one at a time
            latencies = []
            mark = len(cluster.requests())
            for i in range(args.sequential):
                name = f"seq-{i}"
                started = time.perf_counter()
                post(cluster, PDS_PATH.format(namespace="seq"), pdservice(name, "seq"))
                eventually(
                    lambda name=name: children_by_instance(cluster, "seq")[name] == expected,
                    f"children of {name}",
                    60,
                    0.002,
                )
                latencies.append(time.perf_counter() - started)
            eventually(lambda: statuses_written(cluster, "seq") == args.sequential, "statuses", 60)
            time.sleep(2)  # let kopf's annotations and events land
            writes = writes_by_operator(cluster.requests()[mark:])
            idle_mark = len(cluster.requests())
            time.sleep(3)
            idle_writes = writes_by_operator(cluster.requests()[idle_mark:])

            # 3: a burst
            burst_started = time.perf_counter()
            for i in range(args.burst):
                post(cluster, PDS_PATH.format(namespace="burst"), pdservice(f"burst-{i}", "burst"))
            created = time.perf_counter() - burst_started

            def all_children() -> bool:
                counts = children_by_instance(cluster, "burst")
                return sum(1 for n in range(args.burst) if counts[f"burst-{n}"] == expected) == args.burst

            eventually(all_children, "burst children", 600, 0.25)
            children_done = time.perf_counter() - burst_started
            eventually(lambda: statuses_written(cluster, "burst") == args.burst, "burst statuses", 600, 0.25)
            status_done = time.perf_counter() - burst_started
        finally:
            code = operator.stop()
        if code not in (0, None):
            print(operator.log()[-4000:], file=sys.stderr)

    by_class = collections.Counter(classify(w) for w in writes)
    n = args.sequential
    print(f"children per PDService: {expected}")
    print(
        f"apply -> all children created, {n} PDServices one at a time: p50 "
        f"{percentile(latencies, 0.5) * 1000:.0f} ms, "
        f"p99 {percentile(latencies, 0.99) * 1000:.0f} ms, mean {statistics.mean(latencies) * 1000:.0f} ms"
    )
    print(f"API writes per PDService until settled: {len(writes) / n:.2f}")
    for kind, count in sorted(by_class.items()):
        print(f"  {kind}: {count / n:.2f}")
    print(f"API writes in 3 s idle afterwards: {len(idle_writes)}")
    print(
        f"{args.burst} PDServices created at once (creation took {created:.1f} s): all children after "
        f"{children_done:.1f} s, "
        f"all statuses after {status_done:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
