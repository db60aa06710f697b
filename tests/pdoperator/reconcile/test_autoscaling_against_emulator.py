"""The real operator process sizes a PDService's roles from ``/metrics`` it reads over HTTP, in the one world
of the tests (the emulator in front of the real API server that holds the PDService): a load step scales
decode up, a steady load writes nothing, a drop drains the highest ordinals out of the router first and
shrinks the StatefulSet only once the router says they are idle.

The metrics come from a fake source that plays the router and the engines from what the operator wrote: the
router reports the engines its ConfigMap marks draining (with the requests a test leaves on them), and each
engine the StatefulSet runs reports its share of a scripted load.
"""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from pdconnector.router.config import parse_router_config

from tests.k8s.fake_http import FakeHttpServer
from tests.k8s.harness import Kubectl, eventually, writes_by_operator
from tests.k8s.operator_env import operator_in_one_world
from tests.k8s.server import EmulatedCluster

REPO = pathlib.Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "tiny-cpu.yaml"
PDS = "inference.pdoperator.dev/v1alpha1/pdservices"
STS = "apps/v1/statefulsets"
CM = "v1/configmaps"
NAMESPACE = "default"
NAME = "scaled"
AUTOSCALE_INTERVAL_S = 0.3
AUTOSCALING = {
    "prefill": {"minReplicas": 1, "maxReplicas": 3},
    "decode": {"minReplicas": 1, "maxReplicas": 4},
    "targets": {"waitingRequestsPerPrefill": 4, "runningRequestsPerDecode": 8},
    "scaleUpWindowSeconds": 0,
    "scaleDownWindowSeconds": 2,
}


class FakeMetrics:
    """``/router/<namespace>/<name>`` and ``/engine/<namespace>/<pod>`` in the Prometheus text format."""

    def __init__(self) -> None:
        self.cluster: EmulatedCluster | None = None  # set once the emulator runs
        self.decode_running = 0.0  # spread over the decode engines the router serves
        self.left_on: dict[str, float] = {}  # draining engine -> requests still on it
        self.lock = threading.Lock()
        self.server = FakeHttpServer(self.answer)

    def answer(self, path: str) -> tuple[str, str] | None:
        kind, namespace, name = [*path.strip("/").split("/"), "", "", ""][:3]
        text = self.router(namespace, name) if kind == "router" else self.engine(namespace, name)
        return None if text is None else ("text/plain; version=0.0.4", text)

    def operator_args(self) -> list[str]:
        base = self.server.base_url
        return [
            "--router-metrics-url",
            base + "/router/{namespace}/{name}",
            "--engine-metrics-url",
            base + "/engine/{namespace}/{pod}",
        ]

    def backends(self, namespace: str, name: str) -> dict[str, bool] | None:
        """Pod -> draining, for the decode engines in the router's ConfigMap."""
        assert self.cluster is not None
        configmap = self.cluster.get(CM, namespace, f"{name}-router")
        if configmap is None:
            return None
        config = parse_router_config(configmap["data"]["router.yaml"])
        return {b.name: b.draining for b in config.decode.backends}

    def router(self, namespace: str, name: str) -> str | None:
        backends = self.backends(namespace, name)
        if backends is None:
            return None
        draining = [pod for pod, out in backends.items() if out]
        with self.lock:
            left = dict(self.left_on)
        return "\n".join(
            [
                "# TYPE pd_router_backend_draining gauge",
                *(f'pd_router_backend_draining{{role="decode",backend="{pod}"}} 1' for pod in draining),
                "# TYPE pd_router_backend_in_flight gauge",
                *(
                    f'pd_router_backend_in_flight{{role="decode",backend="{pod}"}} {left.get(pod, 0)}'
                    for pod in draining
                ),
                "",
            ]
        )

    def engine(self, namespace: str, pod: str) -> str | None:
        instance, role, ordinal = pod.rsplit("-", 2)
        assert self.cluster is not None
        statefulset = self.cluster.get(STS, namespace, f"{instance}-{role}")
        if statefulset is None or int(ordinal) >= statefulset["spec"]["replicas"]:
            return None  # no such pod
        running = 0.0
        if role == "decode":
            serving = [p for p, out in (self.backends(namespace, instance) or {}).items() if not out]
            with self.lock:
                running = self.decode_running / len(serving) if pod in serving else 0.0
        return (
            "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {running}\n"
        )


@dataclass
class Env:
    cluster: EmulatedCluster
    kubectl: Kubectl
    metrics: FakeMetrics

    def replicas(self, role: str) -> int:
        statefulset = self.cluster.get(STS, NAMESPACE, f"{NAME}-{role}")
        assert statefulset is not None
        return int(statefulset["spec"]["replicas"])

    def decode_backends(self) -> dict[str, bool]:
        return self.metrics.backends(NAMESPACE, NAME) or {}

    def scaling(self) -> dict[str, Any]:
        pds = self.cluster.get(PDS, NAMESPACE, NAME) or {}
        return (pds.get("status") or {}).get("autoscaling") or {}

    def writes_since(self, index: int) -> list[str]:
        return writes_by_operator(self.cluster.requests()[index:])

    def mark(self) -> int:
        return len(self.cluster.requests())


@pytest.fixture(scope="module")
def env(kubectl: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    metrics = FakeMetrics()
    args = ["-A", "--autoscale-interval", str(AUTOSCALE_INTERVAL_S), *metrics.operator_args()]
    # the KV transfer check stays out of the way: its writes are not the autoscaler's
    args += ["--kv-check-interval", "3600"]
    workdir = tmp_path_factory.mktemp("autoscaling-operator")
    with metrics.server, operator_in_one_world(kubectl, workdir, args) as (cluster, cli, _):
        metrics.cluster = cluster
        manifest = yaml.safe_load(EXAMPLE.read_text())
        manifest["metadata"] = {"name": NAME, "namespace": NAMESPACE}
        manifest["spec"]["autoscaling"] = AUTOSCALING
        cli.apply(yaml.safe_dump(manifest))
        yield Env(cluster, cli, metrics)


def rounds(count: int) -> float:
    """Seconds for ``count`` autoscaler rounds."""
    return count * AUTOSCALE_INTERVAL_S


# How long a scale may take to show: a few rounds here, but the operator's process, the emulator, the real API
# server and pytest share CI's two loaded cores (a bound tells "scales" from "never scales").
SCALES_WITHIN_S = 15.0


def settle(env: Env, quiet: float = rounds(3), timeout: float = 30.0) -> None:
    """Wait until the operator has written nothing for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        since = env.mark()
        threading.Event().wait(quiet)
        if not (writes := env.writes_since(since)):
            return
        assert time.monotonic() < deadline, f"the operator kept writing for {timeout} s: {writes[-3:]}"


def autoscaler_writes(writes: list[str]) -> list[str]:
    """The writes, events aside (each carries a fresh name), as sorted unique lines."""
    return sorted({w for w in writes if "/events" not in w})


# ---------------------------------------------------------------- scenarios, in order


def test_the_operator_starts_the_roles_at_their_minimum_and_holds_without_load(env: Env) -> None:
    eventually(lambda: env.scaling().get("decode"), "status.autoscaling", timeout=30)
    assert env.scaling()["prefill"] == {"replicas": 1, "serving": 1}
    assert env.scaling()["decode"] == {"replicas": 1, "serving": 1}
    eventually(lambda: env.decode_backends() == {f"{NAME}-decode-0": False}, "the router's decode pool")

    settle(env)  # the first reconcile's writes
    since = env.mark()
    threading.Event().wait(rounds(6))
    assert env.writes_since(since) == [], "an idle service at its minimum is left alone"


def test_a_load_step_scales_decode_up_and_writes_only_the_scale(env: Env) -> None:
    since = env.mark()
    env.metrics.decode_running = 24  # three decode engines' worth, on one
    eventually(lambda: env.replicas("decode") == 3, "decode scaled to 3", timeout=SCALES_WITHIN_S)
    eventually(lambda: env.scaling().get("decode") == {"replicas": 3, "serving": 3}, "status of the scale")
    assert env.decode_backends() == {f"{NAME}-decode-{i}": False for i in range(3)}
    assert env.replicas("prefill") == 1, "prefill had no load: it stays"
    assert "decode 1 -> 3: running requests at 3.00x" in env.scaling()["reason"]
    threading.Event().wait(rounds(2))
    writes = env.writes_since(since)
    assert autoscaler_writes(writes) == [
        f"PATCH /api/v1/namespaces/{NAMESPACE}/configmaps/{NAME}-router",
        f"PATCH /apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/{NAME}-decode",
        f"PATCH /apis/inference.pdoperator.dev/v1alpha1/namespaces/{NAMESPACE}/pdservices/{NAME}/status",
    ]
    assert any("/events" in w for w in writes), "an Autoscaled event"


def test_the_same_load_spread_over_the_new_engines_holds_the_scale_and_writes_nothing(env: Env) -> None:
    since = env.mark()
    threading.Event().wait(rounds(8))  # 24 running on 3 engines: at the target
    assert env.writes_since(since) == []
    assert env.replicas("decode") == 3


def test_a_drop_drains_the_highest_ordinals_and_removes_them_only_when_idle(env: Env) -> None:
    with env.metrics.lock:
        env.metrics.decode_running = 6  # one engine's worth
        env.metrics.left_on = {f"{NAME}-decode-2": 1}  # a request still finishing there
    eventually(
        lambda: (
            env.decode_backends()
            == {f"{NAME}-decode-0": False, f"{NAME}-decode-1": True, f"{NAME}-decode-2": True}
        ),
        "the two highest decode ordinals draining",
        timeout=AUTOSCALING["scaleDownWindowSeconds"] + SCALES_WITHIN_S,
    )
    assert env.scaling()["decode"] == {"replicas": 3, "serving": 1}
    assert env.scaling().get("drainingSince")
    since = env.mark()
    threading.Event().wait(rounds(6))
    assert env.replicas("decode") == 3, "an engine with a request on it stays"
    assert env.writes_since(since) == []

    with env.metrics.lock:
        env.metrics.left_on = {}
    eventually(lambda: env.replicas("decode") == 1, "decode shrunk to 1", timeout=SCALES_WITHIN_S)
    eventually(lambda: env.scaling().get("decode") == {"replicas": 1, "serving": 1}, "status of the scale")
    assert env.decode_backends() == {f"{NAME}-decode-0": False}
    assert "drainingSince" not in env.scaling()
    assert "decode 3 -> 1 drained" in env.scaling()["reason"]
    threading.Event().wait(rounds(2))
    assert autoscaler_writes(env.writes_since(since)) == [
        f"PATCH /api/v1/namespaces/{NAMESPACE}/configmaps/{NAME}-router",
        f"PATCH /apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/{NAME}-decode",
        f"PATCH /apis/inference.pdoperator.dev/v1alpha1/namespaces/{NAMESPACE}/pdservices/{NAME}/status",
    ]
