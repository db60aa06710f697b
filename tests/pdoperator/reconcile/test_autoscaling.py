"""spec.autoscaling through the reconciler: the autoscaler's rounds write the roles' replicas and the router's
draining engines, and nothing else; a scale-down drains before it removes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import yaml
from pdconnector.router.config import parse_router_config
from pdoperator.api.model import PDService
from pdoperator.autoscale.rounds import Readings
from pdoperator.autoscale.scale import Scale
from pdoperator.reconcile.kinds import (
    CONFIGMAPS,
    HORIZONTALPODAUTOSCALERS,
    PDSERVICES,
    SCALEDOBJECTS,
    STATEFULSETS,
)
from pdoperator.reconcile.kube import KubeApiError
from pdoperator.reconcile.reconciler import Reconciler
from pdoperator.reconcile.scaling import CONFIG_PROPAGATION_S
from pdoperator.render import RenderDefaults

from tests.pdoperator.reconcile.fake_api import FakeKubeApi, RecordedEvents
from tests.pdoperator.reconcile.test_reconciler import EXAMPLE, reconciler

AUTOSCALING = {
    "prefill": {"minReplicas": 1, "maxReplicas": 4},
    "decode": {"minReplicas": 1, "maxReplicas": 4},
    "targets": {"waitingRequestsPerPrefill": 4, "runningRequestsPerDecode": 8},
    "scaleUpWindowSeconds": 0,
    "scaleDownWindowSeconds": 10,
}


def router_text(draining: Mapping[str, float] | None = None) -> str:
    """The router's /metrics: no TTFT yet; ``draining``: engines out of its pool -> requests left on them."""
    lines = [
        "# TYPE pd_router_backend_draining gauge",
        *(f'pd_router_backend_draining{{role="decode",backend="{name}"}} 1' for name in draining or {}),
        "# TYPE pd_router_backend_in_flight gauge",
        *(
            f'pd_router_backend_in_flight{{role="decode",backend="{name}"}} {left}'
            for name, left in (draining or {}).items()
        ),
    ]
    return "\n".join(lines) + "\n"


def engine_text(waiting: float = 0, running: float = 0) -> str:
    return (
        f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting {waiting}\n"
        f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {running}\n"
    )


class Metrics:
    """A scripted metrics source: what each engine says, and the router's view of draining engines."""

    def __init__(self) -> None:
        self.at = 0.0
        self.running_per_decode = 0.0
        self.draining: dict[str, float] = {}
        self.reads: list[Scale] = []

    async def read(self, pds: PDService, scale: Scale) -> Readings:
        self.reads.append(scale)
        engines = {f"tiny-prefill-{i}": engine_text() for i in range(scale.prefill.replicas)}
        engines |= {
            f"tiny-decode-{i}": engine_text(
                running=self.running_per_decode if i < scale.decode.serving else 0
            )
            for i in range(scale.decode.replicas)
        }
        return Readings(self.at, router_text(self.draining), engines)


def scaled_service(api: FakeKubeApi, **autoscaling: Any) -> dict[str, Any]:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"].update(uid="uid-tiny", generation=1)
    body["spec"]["autoscaling"] = AUTOSCALING | autoscaling
    return api.put(PDSERVICES, body)


def fresh(api: FakeKubeApi) -> dict[str, Any]:
    return api.obj(PDSERVICES, "default", "tiny")


def decode_backends(api: FakeKubeApi) -> list[tuple[str, bool]]:
    config = parse_router_config(api.obj(CONFIGMAPS, "default", "tiny-router")["data"]["router.yaml"])
    return [(b.name, b.draining) for b in config.decode.backends]


def decode_replicas(api: FakeKubeApi) -> int:
    return int(api.obj(STATEFULSETS, "default", "tiny-decode")["spec"]["replicas"])


async def test_the_first_reconcile_records_where_the_roles_start() -> None:
    api = FakeKubeApi()
    await reconciler(api).reconcile(scaled_service(api))
    scaling = fresh(api)["status"]["autoscaling"]
    assert scaling["prefill"] == {"replicas": 1, "serving": 1}
    assert scaling["decode"] == {"replicas": 1, "serving": 1}
    assert scaling["reason"] == "starting at prefill 1, decode 1"


async def test_a_load_step_scales_decode_up_and_a_steady_load_writes_nothing() -> None:
    api, events = FakeKubeApi(), RecordedEvents()
    subject = reconciler(api, events)
    await subject.reconcile(scaled_service(api))
    metrics = Metrics()
    api.writes.clear()

    metrics.running_per_decode = 24  # three engines' worth on one
    assert await subject.autoscale(fresh(api), metrics.read)
    assert sorted(api.writes) == [
        ("patch", "ConfigMap", "tiny-router"),
        ("patch", "PDService", "tiny/status"),
        ("patch", "StatefulSet", "tiny-decode"),
    ]
    assert decode_replicas(api) == 3
    assert decode_backends(api) == [(f"tiny-decode-{i}", False) for i in range(3)]
    assert "decode 1 -> 3: running requests at 3.00x" in fresh(api)["status"]["autoscaling"]["reason"]
    assert any(e[1] == "Autoscaled" for e in events.events)

    api.writes.clear()
    metrics.running_per_decode = 8  # the same load, spread over three
    for second in range(1, 4):
        metrics.at = float(second)
        assert not await subject.autoscale(fresh(api), metrics.read)
    assert api.writes == []


async def test_a_scale_down_drains_the_highest_ordinals_before_the_statefulset_loses_them() -> None:
    api = FakeKubeApi()
    subject = reconciler(api)
    await subject.reconcile(scaled_service(api))
    metrics = Metrics()
    metrics.running_per_decode = 24
    await subject.autoscale(fresh(api), metrics.read)
    assert decode_replicas(api) == 3

    metrics.running_per_decode = 2  # 6 requests on three engines: one engine's worth
    metrics.at = 5.0
    assert not await subject.autoscale(fresh(api), metrics.read), "not before the scale-down window"
    api.writes.clear()
    metrics.at = 20.0
    assert await subject.autoscale(fresh(api), metrics.read)
    # first step: out of the router's pool, still running
    assert sorted(api.writes) == [
        ("patch", "ConfigMap", "tiny-router"),
        ("patch", "PDService", "tiny/status"),
    ]
    assert decode_backends(api) == [
        ("tiny-decode-0", False),
        ("tiny-decode-1", True),
        ("tiny-decode-2", True),
    ]
    assert decode_replicas(api) == 3
    status = fresh(api)["status"]["autoscaling"]
    assert status["decode"] == {"replicas": 3, "serving": 1}
    assert status["drainingSince"]

    api.writes.clear()
    metrics.at = 21.0
    metrics.draining = {"tiny-decode-1": 0, "tiny-decode-2": 1}  # one request still on tiny-decode-2
    assert not await subject.autoscale(fresh(api), metrics.read)
    assert api.writes == []

    metrics.at = 22.0
    metrics.draining = {"tiny-decode-1": 0, "tiny-decode-2": 0}
    assert await subject.autoscale(fresh(api), metrics.read)
    assert sorted(api.writes) == [
        ("patch", "ConfigMap", "tiny-router"),
        ("patch", "PDService", "tiny/status"),
        ("patch", "StatefulSet", "tiny-decode"),
    ]
    assert decode_replicas(api) == 1
    assert decode_backends(api) == [("tiny-decode-0", False)]
    status = fresh(api)["status"]["autoscaling"]
    assert status["decode"] == {"replicas": 1, "serving": 1}
    assert "drainingSince" not in status
    assert "decode 3 -> 1 drained" in status["reason"]


async def test_silent_metrics_hold_the_scale() -> None:
    api = FakeKubeApi()
    subject = reconciler(api)
    await subject.reconcile(scaled_service(api))
    api.writes.clear()

    async def silent(pds: PDService, scale: Scale) -> Readings:
        return Readings(30.0, None, {})

    for _ in range(3):
        assert not await subject.autoscale(fresh(api), silent)
    assert api.writes == []


async def test_without_autoscaling_the_autoscaler_reads_nothing() -> None:
    api = FakeKubeApi()
    subject = reconciler(api)
    body = yaml.safe_load(EXAMPLE.read_text())
    await subject.reconcile(api.put(PDSERVICES, body))
    metrics = Metrics()
    assert not await subject.autoscale(fresh(api), metrics.read)
    assert metrics.reads == []
    assert "autoscaling" not in fresh(api)["status"]


async def test_under_an_hpa_the_router_follows_the_replicas_it_sets_and_the_operator_never_writes_them() -> (
    None
):
    api = FakeKubeApi()
    subject = reconciler(api)
    await subject.reconcile(scaled_service(api, engine="hpa"))
    assert set(name for (kind, _, name) in api.objects if kind == HORIZONTALPODAUTOSCALERS) == {
        "tiny-prefill",
        "tiny-decode",
    }
    assert fresh(api)["status"]["autoscaling"]["reason"] == "sized by a HorizontalPodAutoscaler per role"

    api.obj(STATEFULSETS, "default", "tiny-decode")["spec"]["replicas"] = 3  # the HPA scaled it
    api.writes.clear()
    await subject.reconcile(fresh(api))
    assert ("patch", "StatefulSet", "tiny-decode") not in api.writes
    assert decode_replicas(api) == 3
    assert decode_backends(api) == [(f"tiny-decode-{i}", False) for i in range(3)]
    assert fresh(api)["status"]["autoscaling"]["decode"] == {"replicas": 3, "serving": 3}

    metrics = Metrics()
    assert not await subject.autoscale(fresh(api), metrics.read), "the builtin planner stays out"
    assert metrics.reads == []


async def test_switching_from_keda_to_builtin_deletes_the_scaled_objects() -> None:
    api = FakeKubeApi()
    subject = reconciler(api)
    keda = {"engine": "keda", "prometheus": {"serverAddress": "http://prometheus.monitoring.svc:9090"}}
    await subject.reconcile(scaled_service(api, **keda))
    assert {name for (kind, _, name) in api.objects if kind == SCALEDOBJECTS} == {
        "tiny-prefill",
        "tiny-decode",
    }

    body = fresh(api)
    body["spec"]["autoscaling"] = AUTOSCALING
    body["metadata"]["generation"] = 2
    api.writes.clear()
    await subject.reconcile(body)
    assert ("delete", "ScaledObject", "tiny-prefill") in api.writes
    assert not [key for key in api.objects if key[0] == SCALEDOBJECTS]


async def test_a_cluster_without_keda_serves_every_other_engine_and_names_what_is_missing() -> None:
    api = FakeKubeApi()
    api.uninstalled.add(SCALEDOBJECTS)
    subject = reconciler(api)
    await subject.reconcile(scaled_service(api))  # builtin: the missing kind is read as no objects
    assert decode_replicas(api) == 1

    keda = {"engine": "keda", "prometheus": {"serverAddress": "http://prometheus.monitoring.svc:9090"}}
    body = scaled_service(api, **keda)
    with pytest.raises(KubeApiError, match=r"serves no ScaledObject \(keda.sh/v1alpha1\): install KEDA"):
        await subject.reconcile(body)  # retried by kopf: KEDA may be installed later
    degraded = next(c for c in fresh(api)["status"]["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "CustomResourceMissing")
    assert "install KEDA or choose another spec.autoscaling.engine" in degraded["message"]
    assert decode_replicas(api) == 1  # the engines stay served


async def test_with_several_routers_an_idle_draining_engine_stays_until_every_router_can_have_reloaded() -> (
    None
):
    api = FakeKubeApi()
    now = ["2026-01-01T00:00:00Z"]
    subject = Reconciler(api, RecordedEvents(), RenderDefaults(), clock=lambda: now[0])
    body = scaled_service(api)
    body["spec"]["router"]["replicas"] = 2
    await subject.reconcile(body)
    metrics = Metrics()
    metrics.running_per_decode = 24
    await subject.autoscale(fresh(api), metrics.read)
    metrics.running_per_decode, metrics.at = 2, 20.0
    assert await subject.autoscale(fresh(api), metrics.read)  # tiny-decode-1 and -2 start draining
    assert fresh(api)["status"]["autoscaling"]["drainingSince"] == now[0]

    metrics.draining = {"tiny-decode-1": 0, "tiny-decode-2": 0}  # idle, as the router we read says
    for seconds, at in ((10, 21.0), (CONFIG_PROPAGATION_S - 1, 22.0)):
        now[0], metrics.at = f"2026-01-01T00:{seconds // 60:02d}:{seconds % 60:02d}Z", at
        assert not await subject.autoscale(fresh(api), metrics.read), "the other router may not know yet"
    assert decode_replicas(api) == 3

    now[0], metrics.at = (
        f"2026-01-01T00:{CONFIG_PROPAGATION_S // 60:02d}:{CONFIG_PROPAGATION_S % 60:02d}Z",
        23.0,
    )
    assert await subject.autoscale(fresh(api), metrics.read)
    assert decode_replicas(api) == 1
    assert "decode 3 -> 1 drained" in fresh(api)["status"]["autoscaling"]["reason"]
