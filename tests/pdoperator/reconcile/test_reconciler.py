"""The reconciler against an in-memory API: what it writes, and above all what it does not."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import pytest
import yaml
from pdoperator.api.model import PDService
from pdoperator.api.status import ConditionStatus
from pdoperator.reconcile.kinds import (
    CHILD_KINDS,
    CONFIGMAPS,
    DEPLOYMENTS,
    LEADERWORKERSETS,
    PDSERVICES,
    STATEFULSETS,
)
from pdoperator.reconcile.kube import KubeApiError
from pdoperator.reconcile.kvtransfer import RouterStatusError, TransferCounts
from pdoperator.reconcile.reconciler import InvalidSpecError, Reconciler
from pdoperator.render import RenderDefaults

from tests.pdoperator.reconcile.fake_api import FakeKubeApi, RecordedEvents

EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "tiny-cpu.yaml"
NOW = "2026-01-01T00:00:00Z"


def make(api: FakeKubeApi, **spec: Any) -> dict[str, Any]:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"].update(uid="uid-tiny", generation=1)
    body["spec"].update(spec)
    return api.put(PDSERVICES, body)


def reconciler(api: FakeKubeApi, events: RecordedEvents | None = None) -> Reconciler:
    return Reconciler(api, events or RecordedEvents(), RenderDefaults(), clock=lambda: NOW)


def fresh(api: FakeKubeApi) -> dict[str, Any]:
    return api.obj(PDSERVICES, "default", "tiny")


def edit_spec(api: FakeKubeApi, **changes: Any) -> dict[str, Any]:
    body = fresh(api)
    for path, value in changes.items():
        node = body["spec"]
        keys = path.split("__")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    body["metadata"]["generation"] += 1
    return body


def set_ready(api: FakeKubeApi) -> None:
    for kind in (STATEFULSETS, DEPLOYMENTS):
        for (k, _, _), obj in api.objects.items():
            if k == kind:
                replicas = obj["spec"].get("replicas", 1)
                obj["status"] = {
                    "observedGeneration": obj["metadata"]["generation"],
                    "replicas": replicas,
                    "readyReplicas": replicas,
                    "updatedReplicas": replicas,
                }


async def test_first_reconcile_creates_every_child_then_writes_the_status() -> None:
    api, events = FakeKubeApi(), RecordedEvents()
    outcome = await reconciler(api, events).reconcile(make(api))
    created = [w for w in api.writes if w[0] == "create"]
    assert len(created) == len(outcome.actions) >= 9
    assert api.writes[-1] == ("patch", "PDService", "tiny/status")
    assert events.reasons() == ["ChildrenCreated"]
    status = fresh(api)["status"]
    assert status["phase"] == "Pending"
    assert status["observedGeneration"] == 1


async def test_reconciling_an_unchanged_pdservice_writes_nothing() -> None:
    api = FakeKubeApi()
    subject = reconciler(api)
    await subject.reconcile(make(api))
    api.writes.clear()
    outcome = await subject.reconcile(fresh(api))
    assert (outcome.writes, api.writes) == (0, [])


async def test_server_defaulted_fields_do_not_count_as_drift() -> None:
    api = FakeKubeApi()
    subject = reconciler(api)
    await subject.reconcile(make(api))
    sts = api.obj(STATEFULSETS, "default", "tiny-decode")
    sts["spec"]["revisionHistoryLimit"] = 10
    sts["spec"]["updateStrategy"]["rollingUpdate"] = {"partition": 0}
    sts["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "IfNotPresent"
    sts["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    api.writes.clear()
    await subject.reconcile(fresh(api))
    assert api.writes == []


async def test_scaling_decode_patches_only_the_decode_statefulset_and_the_router_configmap() -> None:
    api = FakeKubeApi()
    subject = reconciler(api)
    await subject.reconcile(make(api))
    api.writes.clear()
    await subject.reconcile(edit_spec(api, decode__replicas=2))
    assert sorted(api.writes) == [
        ("patch", "ConfigMap", "tiny-router"),
        ("patch", "PDService", "tiny/status"),
        ("patch", "StatefulSet", "tiny-decode"),
    ]
    assert api.obj(STATEFULSETS, "default", "tiny-decode")["spec"]["replicas"] == 2


async def test_a_field_no_longer_rendered_is_removed_from_the_child() -> None:
    api = FakeKubeApi()
    subject = reconciler(api)
    await subject.reconcile(make(api))
    await subject.reconcile(edit_spec(api, decode__nodeSelector={"pool": "decode"}))
    assert api.obj(STATEFULSETS, "default", "tiny-decode")["spec"]["template"]["spec"]["nodeSelector"] == {
        "pool": "decode"
    }
    await subject.reconcile(edit_spec(api, decode__nodeSelector={}))
    assert not api.obj(STATEFULSETS, "default", "tiny-decode")["spec"]["template"]["spec"].get("nodeSelector")


async def test_ready_children_make_the_status_ready_and_a_second_pass_writes_nothing() -> None:
    api = FakeKubeApi()
    subject = reconciler(api)
    await subject.reconcile(make(api))
    set_ready(api)
    await subject.reconcile(fresh(api))
    status = fresh(api)["status"]
    assert status["phase"] == "Ready"
    assert [c["type"] for c in status["conditions"]] == [
        "SpecValid",
        "Ready",
        "Progressing",
        "Degraded",
        "KVTransferVerified",
    ]
    assert status["conditions"][-1]["reason"] == "AwaitingRouter"
    api.writes.clear()
    await subject.reconcile(fresh(api))
    assert api.writes == []


async def test_an_invalid_spec_writes_only_the_status_and_one_warning() -> None:
    api, events = FakeKubeApi(), RecordedEvents()
    body = make(api)
    body["spec"]["engine"]["runtime"] = "vllm"
    subject = reconciler(api, events)
    with pytest.raises(InvalidSpecError, match=r"spec\.engine"):
        await subject.reconcile(body)
    assert api.writes == [("patch", "PDService", "tiny/status")]
    assert [e[:2] for e in events.events] == [("Warning", "InvalidSpec")]
    spec_valid = next(c for c in fresh(api)["status"]["conditions"] if c["type"] == "SpecValid")
    assert spec_valid["status"] == "False" and "spec.engine" in spec_valid["message"]
    with pytest.raises(InvalidSpecError):
        await subject.reconcile(fresh(api))  # the operator restarts: same generation, already reported
    assert len(events.events) == 1 and len(api.writes) == 1


async def test_a_deleted_child_is_recreated_by_a_child_triggered_reconcile() -> None:
    api, events = FakeKubeApi(), RecordedEvents()
    subject = reconciler(api, events)
    await subject.reconcile(make(api))
    del api.objects[(CONFIGMAPS, "default", "tiny-router")]
    api.writes.clear()
    await subject.request("default", "tiny")
    assert api.writes == [("create", "ConfigMap", "tiny-router")]
    assert events.reasons()[-1] == "DriftCorrected"


async def test_a_pdservice_being_deleted_gets_no_children_back() -> None:
    api = FakeKubeApi()
    subject = reconciler(api)
    await subject.reconcile(make(api))
    fresh(api)["metadata"]["deletionTimestamp"] = NOW
    del api.objects[(STATEFULSETS, "default", "tiny-decode")]
    api.writes.clear()
    assert await subject.request("default", "tiny") is None
    assert api.writes == []


async def test_child_events_arriving_during_a_reconcile_collapse_into_one_follow_up() -> None:
    api = FakeKubeApi()
    subject = reconciler(api)
    await subject.reconcile(make(api))
    api.reads = 0
    results = await asyncio.gather(*(subject.request("default", "tiny") for _ in range(10)))
    assert sum(r is not None for r in results) == 2  # the first one, and one for all that arrived meanwhile
    assert api.reads == 2 * (1 + len(CHILD_KINDS))  # each: one GET of the PDService, one list per child kind


async def test_delete_children_removes_only_what_this_pdservice_controls() -> None:
    api, events = FakeKubeApi(), RecordedEvents()
    subject = reconciler(api, events)
    await subject.reconcile(make(api))
    foreign = api.put(
        CONFIGMAPS,
        {
            "metadata": {
                "name": "tiny-extra",
                "namespace": "default",
                "labels": {"app.kubernetes.io/name": "pd-operator", "app.kubernetes.io/instance": "tiny"},
            }
        },
    )
    deleted = await subject.delete_children(fresh(api))
    assert deleted and all(name.startswith("deleted ") for name in deleted)
    remaining = [key for key in api.objects if key[0] != PDSERVICES]
    assert remaining == [(CONFIGMAPS, "default", foreign["metadata"]["name"])]
    assert events.reasons()[-1] == "ChildrenDeleted"


async def ready_service(api: FakeKubeApi, subject: Reconciler) -> None:
    await subject.reconcile(make(api))
    set_ready(api)
    await subject.reconcile(fresh(api))


async def test_the_router_is_not_probed_before_it_is_ready() -> None:
    api = FakeKubeApi()
    subject = reconciler(api)
    await subject.reconcile(make(api))

    async def fetch(pds: PDService) -> TransferCounts:
        raise AssertionError("probed a router that is not ready")

    assert await subject.probe_kv_transfer(fresh(api), fetch) is False


async def test_kv_probe_sets_the_condition_once_and_leaves_it_while_counts_are_unchanged() -> None:
    api, events = FakeKubeApi(), RecordedEvents()
    subject = reconciler(api, events)
    await ready_service(api, subject)
    counts = TransferCounts(0, 0)

    async def fetch(pds: PDService) -> TransferCounts:
        return counts

    assert await subject.probe_kv_transfer(fresh(api), fetch) is True
    assert _kv(api)["reason"] == "NoTraffic"
    assert await subject.probe_kv_transfer(fresh(api), fetch) is False
    counts = TransferCounts(3, 1)
    assert await subject.probe_kv_transfer(fresh(api), fetch) is True
    assert (_kv(api)["status"], _kv(api)["reason"]) == (ConditionStatus.FALSE.value, "ServedWithoutTransfer")
    assert fresh(api)["status"]["phase"] == "Degraded"
    assert "ServedWithoutTransfer" in events.reasons()


async def test_kv_probe_failures_never_erase_a_stored_verdict() -> None:
    api = FakeKubeApi()
    subject = reconciler(api)
    await ready_service(api, subject)

    async def verified(pds: PDService) -> TransferCounts:
        return TransferCounts(5, 0)

    async def unreachable(pds: PDService) -> TransferCounts:
        raise RouterStatusError("connection refused")

    await subject.probe_kv_transfer(fresh(api), verified)
    api.writes.clear()
    assert await subject.probe_kv_transfer(fresh(api), unreachable) is False
    assert api.writes == [] and _kv(api)["status"] == "True"


async def test_a_restarted_operator_takes_the_router_counts_as_a_baseline() -> None:
    api = FakeKubeApi()
    await ready_service(api, reconciler(api))

    async def mixed(pds: PDService) -> TransferCounts:
        return TransferCounts(9, 2)  # 2 unverified long ago, all verified since

    first = reconciler(api)
    await first.probe_kv_transfer(fresh(api), mixed)  # totals: served without transfer
    fresh(api)["status"]["conditions"] = [
        c for c in fresh(api)["status"]["conditions"] if c["type"] != "KVTransferVerified"
    ]
    fresh(api)["status"]["conditions"].append(
        {
            "type": "KVTransferVerified",
            "status": "True",
            "reason": "TransfersVerified",
            "message": "m",
            "lastTransitionTime": NOW,
        }
    )
    restarted = reconciler(api)
    api.writes.clear()
    assert await restarted.probe_kv_transfer(fresh(api), mixed) is False
    assert api.writes == []


def _kv(api: FakeKubeApi) -> dict[str, Any]:
    return next(c for c in fresh(api)["status"]["conditions"] if c["type"] == "KVTransferVerified")


async def test_child_events_that_echo_the_operators_own_writes_are_recognised() -> None:
    api = FakeKubeApi()
    subject = reconciler(api)
    await subject.reconcile(make(api))
    sts = api.obj(STATEFULSETS, "default", "tiny-decode")
    assert subject.is_own_write("statefulsets", "default", "tiny-decode", sts["metadata"]["resourceVersion"])
    await api.patch(STATEFULSETS, "default", "tiny-decode", {"spec": {"replicas": 4}})  # someone else
    edited = api.obj(STATEFULSETS, "default", "tiny-decode")["metadata"]["resourceVersion"]
    assert not subject.is_own_write("statefulsets", "default", "tiny-decode", edited)


class ImmutableStatefulSets(FakeKubeApi):
    """Rejects StatefulSet patches the way the API server rejects changes to immutable fields."""

    async def patch(self, kind, namespace, name, patch, subresource=None):
        if kind == STATEFULSETS and subresource is None:
            self.writes.append(("patch", kind.kind, name))
            raise KubeApiError(
                422, "Invalid", "spec: Forbidden: updates to statefulset spec for fields other than ..."
            )
        return await super().patch(kind, namespace, name, patch, subresource)


async def test_a_child_whose_change_is_rejected_as_immutable_is_replaced() -> None:
    api = ImmutableStatefulSets()
    subject = reconciler(api)
    await subject.reconcile(make(api))
    await subject.reconcile(edit_spec(api, decode__replicas=2))
    assert ("delete", "StatefulSet", "tiny-decode") in api.writes
    api.writes.clear()
    await subject.request("default", "tiny")  # its DELETED event
    assert api.writes[0] == ("create", "StatefulSet", "tiny-decode")
    assert api.obj(STATEFULSETS, "default", "tiny-decode")["spec"]["replicas"] == 2


async def test_a_cluster_without_the_leader_worker_set_crd_gets_the_rest_and_a_condition_naming_it() -> None:
    """Engines that span nodes need the LeaderWorkerSet controller: until its CRD is served, everything else
    is applied, the status says what to install, and the reconcile fails so that kopf retries it."""
    api = FakeKubeApi()
    api.uninstalled.add(LEADERWORKERSETS)
    body = yaml.safe_load((EXAMPLE.parent / "deepseek-v3-multinode.yaml").read_text())
    body["metadata"].update(uid="uid-ds", generation=1)
    api.put(PDSERVICES, body)
    with pytest.raises(KubeApiError, match=r"serves no LeaderWorkerSet \(leaderworkerset.x-k8s.io/v1\)"):
        await reconciler(api).reconcile(api.obj(PDSERVICES, "inference", "deepseek-v3"))
    status = api.obj(PDSERVICES, "inference", "deepseek-v3")["status"]
    assert status["phase"] == "Degraded"
    (degraded,) = [c for c in status["conditions"] if c["type"] == "Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "CustomResourceMissing")
    assert "install the LeaderWorkerSet controller (kubernetes-sigs/lws" in degraded["message"]
    assert api.obj(DEPLOYMENTS, "inference", "deepseek-v3-router") is not None
    assert api.obj(CONFIGMAPS, "inference", "deepseek-v3-router") is not None

    api.uninstalled.clear()  # the controller is installed: the retry creates the groups
    await reconciler(api).reconcile(api.obj(PDSERVICES, "inference", "deepseek-v3"))
    assert (
        api.obj(LEADERWORKERSETS, "inference", "deepseek-v3-decode")["spec"]["leaderWorkerTemplate"]["size"]
        == 2
    )
