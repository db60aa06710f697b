"""The real operator process in the one world of the tests, driven by the real kubectl: the emulator serves
the children (StatefulSets, Services, ConfigMaps...) and forwards PDServices to the real CRD-serving API
server, which validates, defaults and stores them (``tests/k8s/operator_env.py``).

One world and one operator serve the whole module (start-up costs seconds); every scenario
uses its own PDService and namespace so the scenarios stay independent. The last test checks every
request the operator made during the module against the RBAC rules.
"""

from __future__ import annotations

import json
import pathlib
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
import yaml
from pdoperator.api import parse_pdservice
from pdoperator.rbac import is_granted
from pdoperator.reconcile.diff import is_subset
from pdoperator.render import RenderDefaults, render_pdservice
from pdoperator.render.names import LABEL_COMPAT

from tests.k8s.harness import OperatorProcess, eventually, is_operator_request, rbac_attributes
from tests.k8s.operator_env import operator_in_one_world, watching_pdservices
from tests.pdoperator.reconcile.operator_scenarios import (
    CHILD_RESOURCES,
    CM,
    DEPLOY,
    EXAMPLE,
    PDS,
    STS,
    Env,
    FakeRouterStatus,
    apply,
    condition,
    kind_of,
    mark_ready,
    quiet,
    tiny,
    wait_children,
)

# Every namespace the scenarios use but team-h, which one of them creates itself.
NAMESPACES = [f"team-{x}" for x in "abcdefgijk"]


@pytest.fixture(scope="module")
def env(kubectl: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    router = FakeRouterStatus()
    args = ["-A", "--router-status-url", router.url_template, "--kv-check-interval", "0.5"]
    workdir = tmp_path_factory.mktemp("operator")
    with router.server, operator_in_one_world(kubectl, workdir, args, NAMESPACES) as running:
        yield Env(*running, router)


# ---------------------------------------------------------------- scenarios


def test_applying_the_tiny_example_creates_every_rendered_child_owned_by_the_pdservice(env: Env) -> None:
    env.kubectl.run("apply", "--validate=false", "-f", str(EXAMPLE))
    children = wait_children(env, "default", "tiny")
    pds_obj = env.pds("default", "tiny")
    rendered = render_pdservice(parse_pdservice(pds_obj), RenderDefaults())
    assert {(m["kind"], m["metadata"]["name"]) for m in rendered} == {(kind_of(r), n) for r, n in children}
    by_name = {(kind_of(r), n): obj for (r, n), obj in children.items()}
    for manifest in rendered:
        live = by_name[(manifest["kind"], manifest["metadata"]["name"])]
        assert is_subset({k: v for k, v in manifest.items() if k not in ("apiVersion", "kind")}, live), (
            manifest["metadata"]["name"]
        )
        (owner,) = live["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "inference.pdoperator.dev/v1alpha1",
            "kind": "PDService",
            "name": "tiny",
            "uid": pds_obj["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    status = eventually(
        lambda: env.status("default", "tiny").get("phase") and env.status("default", "tiny"), "a status"
    )
    assert status["phase"] == "Pending"
    assert status["routerEndpoint"] == "http://tiny-router.default.svc.cluster.local:8000"
    assert condition(status, "SpecValid")["status"] == "True"
    assert condition(status, "Ready")["status"] == "False"
    eventually(
        lambda: any(
            e["reason"] == "ChildrenCreated" and e["type"] == "Normal" for e in env.events("default", "tiny")
        ),
        "ChildrenCreated",
    )


def test_ready_children_make_the_pdservice_ready_with_per_role_counts_and_printer_columns_show_them(
    env: Env,
) -> None:
    apply(
        env,
        tiny(
            "ready", "team-a", prefill__tensorParallelSize=1, decode__tensorParallelSize=1, decode__replicas=2
        ),
    )
    wait_children(env, "team-a", "ready")
    mark_ready(env, "team-a", "ready")
    status = eventually(
        lambda: (s := env.status("team-a", "ready")).get("phase") == "Ready" and s, "phase Ready"
    )
    assert status["prefill"] == {"desiredReplicas": 1, "readyReplicas": 1, "summary": "1/1"}
    assert status["decode"] == {"desiredReplicas": 2, "readyReplicas": 2, "summary": "2/2"}
    assert status["router"] == {"desiredReplicas": 1, "readyReplicas": 1, "summary": "1/1"}
    assert status["observedGeneration"] == env.pds("team-a", "ready")["metadata"]["generation"]
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "AllReplicasReady")
    assert condition(status, "Progressing")["status"] == "False"
    assert condition(status, "Degraded")["status"] == "False"

    crd = env.kubectl.get_json("crd", "pdservices.inference.pdoperator.dev")
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    spec = ",".join(f"{c['name']}:{c['jsonPath']}" for c in columns)
    table = env.kubectl.run(
        "get", "pds", "ready", "-n", "team-a", "-o", f"custom-columns={spec}"
    ).stdout.splitlines()
    values = dict(zip(table[0].split(), table[1].split(), strict=True))
    expected = {
        "Mode": "push",
        "Model": "tiny-llama",
        "Prefill": "1/1",
        "Decode": "2/2",
        "P-TP": "1",
        "D-TP": "1",
        "Ready": "True",
        "Phase": "Ready",
    }
    assert {k: values[k] for k in expected} == expected
    assert values["Endpoint"] == "http://ready-router.team-a.svc.cluster.local:8000"
    assert values["Age"] == env.pds("team-a", "ready")["metadata"]["creationTimestamp"]


def test_scaling_decode_patches_only_the_decode_statefulset_and_the_router_config(env: Env) -> None:
    apply(env, tiny("scale", "team-b"))
    wait_children(env, "team-b", "scale")
    mark_ready(env, "team-b", "scale")
    eventually(lambda: env.status("team-b", "scale").get("phase") == "Ready", "phase Ready")
    quiet(env)
    before = env.children("team-b", "scale")
    mark = env.request_count()
    env.kubectl.run(
        "patch", "pds", "scale", "-n", "team-b", "--type=merge", "-p", '{"spec":{"decode":{"replicas":3}}}'
    )
    eventually(
        lambda: env.status("team-b", "scale")["decode"]["desiredReplicas"] == 3, "decode desired 3 in status"
    )
    quiet(env)
    child_writes = [
        w for w in env.operator_writes_since(mark) if "/pdservices/" not in w and "/events" not in w
    ]
    assert sorted(child_writes) == [
        "PATCH /api/v1/namespaces/team-b/configmaps/scale-router",
        "PATCH /apis/apps/v1/namespaces/team-b/statefulsets/scale-decode",
    ]
    after = env.children("team-b", "scale")
    assert after[(STS, "scale-decode")]["spec"]["replicas"] == 3
    assert (
        after[(STS, "scale-prefill")]["metadata"]["resourceVersion"]
        == before[(STS, "scale-prefill")]["metadata"]["resourceVersion"]
    )
    # the new decode replicas are not ready yet
    assert env.status("team-b", "scale")["phase"] in ("Progressing", "Degraded")


def test_switching_push_to_pull_rolls_both_roles_to_one_new_compat_hash(env: Env) -> None:
    apply(env, tiny("mode", "team-c"))
    before = wait_children(env, "team-c", "mode")
    old = {
        role: before[(STS, f"mode-{role}")]["spec"]["template"]["metadata"]["labels"][LABEL_COMPAT]
        for role in ("prefill", "decode")
    }
    assert old["prefill"] == old["decode"]
    mark = env.request_count()
    env.kubectl.run("patch", "pds", "mode", "-n", "team-c", "--type=merge", "-p", '{"spec":{"mode":"pull"}}')

    def new_hashes() -> dict[str, str] | None:
        children = env.children("team-c", "mode")
        labels = {
            role: children[(STS, f"mode-{role}")]["spec"]["template"]["metadata"]["labels"][LABEL_COMPAT]
            for role in ("prefill", "decode")
        }
        return labels if labels["prefill"] != old["prefill"] and labels["decode"] != old["decode"] else None

    new = eventually(new_hashes, "both roles with a new compat hash")
    assert new["prefill"] == new["decode"]
    quiet(env)
    writes = env.operator_writes_since(mark)
    assert "PATCH /apis/apps/v1/namespaces/team-c/statefulsets/mode-prefill" in writes
    assert "PATCH /apis/apps/v1/namespaces/team-c/statefulsets/mode-decode" in writes
    assert "PATCH /api/v1/namespaces/team-c/configmaps/mode-router" in writes
    router_config = env.cluster.get(CM, "team-c", "mode-router")
    assert router_config is not None and new["prefill"] in json.dumps(router_config["data"])
    eventually(
        lambda: any(e["reason"] == "RolloutStarted" for e in env.events("team-c", "mode")),
        "a RolloutStarted event",
    )


def test_an_invalid_spec_is_reported_once_with_the_field_and_touches_no_children(env: Env) -> None:
    # A rule the CRD cannot express (the real server checks the rest itself: see the next test).
    bad = tiny("bad", "team-d", prefill__extraArgs=["--port=9000"])
    apply(env, bad)
    status = eventually(
        lambda: (s := env.status("team-d", "bad")).get("phase") == "Invalid" and s, "phase Invalid"
    )
    spec_valid = condition(status, "SpecValid")
    assert (spec_valid["status"], spec_valid["reason"]) == ("False", "InvalidSpec")
    assert "spec.prefill.extraArgs[0]" in spec_valid["message"]
    warnings = eventually(
        lambda: [
            e for e in env.events("team-d", "bad") if e["type"] == "Warning" and e["reason"] == "InvalidSpec"
        ],
        "a warning",
    )
    assert len(warnings) == 1 and "spec.prefill.extraArgs[0]" in warnings[0]["message"]
    assert env.children("team-d", "bad") == {}
    mark = env.request_count()
    time.sleep(3)  # kopf would retry an ordinary failure within seconds: a permanent one is not retried
    assert env.operator_writes_since(mark) == []
    assert env.operator.running


def test_a_valid_pdservice_made_invalid_keeps_its_children_as_they_are(env: Env) -> None:
    apply(env, tiny("turns-bad", "team-d"))
    wait_children(env, "team-d", "turns-bad")
    quiet(env)
    before = env.children("team-d", "turns-bad")
    # The real server refuses what its CEL rules catch, naming the field: nothing reaches the operator.
    refused = env.kubectl.run(
        "patch",
        "pds",
        "turns-bad",
        "-n",
        "team-d",
        "--type=merge",
        "-p",
        '{"spec":{"engine":{"runtime":"vllm"}}}',
        check=False,
    )
    assert refused.returncode != 0 and "spec.engine.transport.backend" in refused.stderr
    env.kubectl.run(
        "patch",
        "pds",
        "turns-bad",
        "-n",
        "team-d",
        "--type=merge",
        "-p",
        '{"spec":{"decode":{"extraArgs":["--port=9000"]}}}',
    )
    eventually(lambda: env.status("team-d", "turns-bad").get("phase") == "Invalid", "phase Invalid")
    after = env.children("team-d", "turns-bad")
    assert {k: v["metadata"]["resourceVersion"] for k, v in after.items()} == {
        k: v["metadata"]["resourceVersion"] for k, v in before.items()
    }


def test_a_deleted_child_is_restored_and_a_hand_edit_is_reverted(env: Env) -> None:
    apply(env, tiny("drift", "team-e"))
    before = wait_children(env, "team-e", "drift")
    quiet(env)
    old_uid = before[(STS, "drift-decode")]["metadata"]["uid"]
    env.kubectl.run("delete", "statefulset", "drift-decode", "-n", "team-e")
    restored = eventually(
        lambda: (
            (o := env.cluster.get(STS, "team-e", "drift-decode")) and o["metadata"]["uid"] != old_uid and o
        ),
        "the decode StatefulSet back",
        timeout=5,
    )
    assert restored["spec"] == before[(STS, "drift-decode")]["spec"]

    env.kubectl.run(
        "patch", "deployment", "drift-router", "-n", "team-e", "--type=merge", "-p", '{"spec":{"replicas":5}}'
    )
    eventually(
        lambda: env.cluster.get(DEPLOY, "team-e", "drift-router")["spec"]["replicas"] == 1,
        "router replicas back to 1",
        timeout=5,
    )
    env.kubectl.run(
        "patch", "configmap", "drift-router", "-n", "team-e", "--type=merge", "-p", '{"data":{"extra":"x"}}'
    )
    eventually(
        lambda: "extra" not in env.cluster.get(CM, "team-e", "drift-router")["data"],
        "hand-added ConfigMap key removed",
        timeout=5,
    )
    eventually(
        lambda: any(e["reason"] == "DriftCorrected" for e in env.events("team-e", "drift")),
        "a DriftCorrected event",
    )


def test_kv_transfer_verified_follows_the_router_counts(env: Env) -> None:
    apply(env, tiny("kv", "team-f"))
    wait_children(env, "team-f", "kv")
    awaiting = eventually(
        lambda: condition(env.status("team-f", "kv"), "KVTransferVerified"), "a KVTransferVerified condition"
    )
    assert (awaiting["status"], awaiting["reason"]) == ("Unknown", "AwaitingRouter")
    mark_ready(env, "team-f", "kv")
    assert eventually(
        lambda: condition(env.status("team-f", "kv"), "KVTransferVerified")["reason"] == "RouterUnreachable",
        "RouterUnreachable",
    )

    env.router.counts[("team-f", "kv")] = (0, 0)
    unknown = eventually(
        lambda: (
            (c := condition(env.status("team-f", "kv"), "KVTransferVerified"))["reason"] == "NoTraffic" and c
        ),
        "NoTraffic",
    )
    assert unknown["status"] == "Unknown"

    env.router.counts[("team-f", "kv")] = (4, 0)
    verified = eventually(
        lambda: (c := condition(env.status("team-f", "kv"), "KVTransferVerified"))["status"] == "True" and c,
        "verified",
    )
    assert verified["reason"] == "TransfersVerified"

    env.router.counts[("team-f", "kv")] = (4, 2)
    failed = eventually(
        lambda: (c := condition(env.status("team-f", "kv"), "KVTransferVerified"))["status"] == "False" and c,
        "served without transfer",
    )
    assert failed["reason"] == "ServedWithoutTransfer"
    status = env.status("team-f", "kv")
    assert condition(status, "Degraded")["status"] == "True" and status["phase"] == "Degraded"
    eventually(
        lambda: any(
            e["type"] == "Warning" and e["reason"] == "ServedWithoutTransfer"
            for e in env.events("team-f", "kv")
        ),
        "a warning",
    )

    env.router.counts[("team-f", "kv")] = (9, 2)  # transfers work again
    eventually(
        lambda: condition(env.status("team-f", "kv"), "KVTransferVerified")["status"] == "True",
        "verified again",
    )
    mark = env.request_count()
    time.sleep(1.5)  # several probes with unchanged counts
    assert [w for w in env.operator_writes_since(mark) if "/team-f/" in w and "/events" not in w] == []


def test_a_restarted_operator_writes_nothing_and_duplicates_nothing(env: Env) -> None:
    apply(env, tiny("resume", "team-j"))
    wait_children(env, "team-j", "resume")
    mark_ready(env, "team-j", "resume")
    eventually(lambda: env.status("team-j", "resume").get("phase") == "Ready", "phase Ready")
    quiet(env)
    objects_before = {
        r: sorted(o["metadata"]["uid"] for o in env.cluster.objects(r)) for r in (*CHILD_RESOURCES, PDS)
    }
    env.operator.stop()
    mark = env.request_count()
    env.operator.start()
    eventually(
        lambda: watching_pdservices(env.cluster, mark),
        "the restarted operator to watch PDServices",
        timeout=30,
    )
    eventually(
        lambda: "Resuming is processed" in env.operator.log().split("Operator is stopping")[-1],
        "resume handlers to finish",
        timeout=30,
    )
    time.sleep(2)  # KV probes and child events after the resume
    assert env.operator_writes_since(mark) == []
    assert {
        r: sorted(o["metadata"]["uid"] for o in env.cluster.objects(r)) for r in (*CHILD_RESOURCES, PDS)
    } == objects_before


def test_deleting_a_pdservice_completes_its_delete_handler_and_removes_the_children(env: Env) -> None:
    apply(env, tiny("gone", "team-g"))
    wait_children(env, "team-g", "gone")
    assert "inference.pdoperator.dev/finalizer" in env.pds("team-g", "gone")["metadata"]["finalizers"]
    # waits until the finalizer is removed
    env.kubectl.run("delete", "pds", "gone", "-n", "team-g", "--timeout=20s")
    assert env.cluster.get(PDS, "team-g", "gone") is None
    assert eventually(lambda: env.children("team-g", "gone") == {}, "children deleted", timeout=5)
    eventually(
        lambda: any(e["reason"] == "ChildrenDeleted" for e in env.events("team-g", "gone")),
        "a ChildrenDeleted event",
    )


def test_a_namespaced_operator_serves_only_its_namespaces_with_json_logs_liveness_and_metrics(
    env: Env, tmp_path: pathlib.Path, unused_tcp_port_factory: Callable[[], int]
) -> None:
    env.kubectl.apply(
        yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-h"}})
    )
    env.operator.stop()
    health_port, metrics_port = unused_tcp_port_factory(), unused_tcp_port_factory()
    args = [
        "--namespace",
        "team-h",
        "--log-format",
        "json",
        "--liveness",
        f"http://127.0.0.1:{health_port}/healthz",
    ]
    args += ["--metrics-port", str(metrics_port)]
    scoped = OperatorProcess(env.operator.kubeconfig, tmp_path / "scoped.log", args)
    scoped.start()
    try:
        apply(env, tiny("inside", "team-h"))
        apply(env, tiny("outside", "team-i"))
        wait_children(env, "team-h", "inside")
        health = eventually(lambda: _get(f"http://127.0.0.1:{health_port}/healthz"), "the liveness endpoint")
        assert health == 200
        # the counter moves after the API answers, so the children can be seen a moment before it does
        eventually(
            lambda: (
                'pd_operator_child_writes_total{action="create",kind="StatefulSet"} 2.0'
                in _metrics(metrics_port)
            ),
            "two StatefulSet creations on /metrics",
        )
        time.sleep(1)
        assert env.children("team-i", "outside") == {}
    finally:
        scoped.stop()
        restart(env)  # the module's operator picks "outside" up again
    lines = [line for line in scoped.log().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is a JSON object
    assert any(r.get("message", "").startswith("Handler 'reconcile' succeeded") for r in records)
    wait_children(env, "team-i", "outside")


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def _get(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except OSError:
        return None


KOPF_PEERING = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: clusterkopfpeerings.kopf.dev}
spec:
  scope: Cluster
  group: kopf.dev
  names: {kind: ClusterKopfPeering, plural: clusterkopfpeerings, singular: clusterkopfpeering}
  versions:
  - name: v1
    served: true
    storage: true
    schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
"""


def test_peered_replicas_keep_one_active_and_the_standby_takes_over_when_it_leaves(
    env: Env, tmp_path: pathlib.Path
) -> None:
    env.kubectl.apply(KOPF_PEERING)
    eventually(
        lambda: env.kubectl.run("get", "crd", "clusterkopfpeerings.kopf.dev", check=False).returncode == 0,
        "the peering CRD",
    )
    env.kubectl.apply(
        yaml.safe_dump(
            {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "pd-operator"}}
        )
    )
    env.operator.stop()
    high = OperatorProcess(
        env.operator.kubeconfig, tmp_path / "high.log", ["-A", "--peering", "pd-operator", "--priority", "20"]
    )
    low = OperatorProcess(
        env.operator.kubeconfig,
        tmp_path / "low.log",
        ["-A", "--peering", "pd-operator", "--priority", "10", "--verbose"],
    )
    try:
        high.start()
        eventually(lambda: "Resuming is processed" in high.log(), "the first replica to work", timeout=30)
        low.start()
        eventually(
            lambda: "Pausing the watch-stream for pdservices" in low.log(),
            "the low-priority replica to stand by",
            timeout=30,
        )
        peers = env.kubectl.get_json("clusterkopfpeering", "pd-operator")["status"]
        assert sorted(peer["priority"] for peer in peers.values()) == [10, 20]
        apply(env, tiny("peered", "team-k"))
        wait_children(env, "team-k", "peered")
        high.stop()
        eventually(
            lambda: "Resuming operations after the pause" in low.log(), "the standby to take over", timeout=30
        )
        standby_part = low.log().split("Resuming operations after the pause")[0]
        assert "Handler 'reconcile'" not in standby_part  # nothing was handled while standing by
        eventually(lambda: "Handler 'reconcile'" in low.log(), "the new active replica to work", timeout=30)
    finally:
        high.stop()
        low.stop()
        restart(env)


def restart(env: Env) -> None:
    """Start the module's operator again and wait until it watches PDServices."""
    mark = env.request_count()
    env.operator.start()
    eventually(
        lambda: watching_pdservices(env.cluster, mark), "the operator to watch PDServices again", timeout=30
    )


def test_every_request_the_operator_made_is_granted_by_its_rbac_rules(env: Env) -> None:
    attributes = {rbac_attributes(r) for r in env.cluster.requests() if is_operator_request(r)} - {None}
    assert attributes, "the operator made no requests"
    denied = sorted(a for a in attributes if a is not None and not is_granted(*a))
    assert denied == []
    used = {(verb, resource) for verb, _, resource in (a for a in attributes if a is not None)}
    assert {
        ("patch", "pdservices/status"),
        ("create", "statefulsets"),
        ("watch", "statefulsets"),
        ("create", "events"),
    } <= used
