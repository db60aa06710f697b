"""Engines that span nodes, with the real operator and kubectl in the one world of the tests: LeaderWorkerSets
created, scaled, rolled out and deleted like StatefulSets, roles counted in groups, and nothing written at
rest. The pinned LeaderWorkerSet CRD is installed whole on the real API server, so every LeaderWorkerSet the
operator writes passes its real schema. (A cluster without the CRD is tested on the fake API:
``test_reconciler.py``.)

Nothing runs controllers: the tests play the LeaderWorkerSet controller by writing its status.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from pdoperator.rbac import is_granted

from tests.k8s.harness import eventually, is_operator_request, rbac_attributes
from tests.k8s.lws_schema import CRD_PATH as LWS_CRD
from tests.k8s.lws_schema import leader_worker_set_errors
from tests.k8s.operator_env import install_crd, one_world, running_operator
from tests.pdoperator.reconcile.operator_scenarios import (
    STS,
    Env,
    FakeRouterStatus,
    apply,
    condition,
    mark_ready,
    quiet,
)

REPO = pathlib.Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "deepseek-v3-multinode.yaml"
LWS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"


@pytest.fixture(scope="module")
def env(kubectl: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    router = FakeRouterStatus()
    args = ["-A", "--router-status-url", router.url_template, "--kv-check-interval", "0.5"]
    workdir = tmp_path_factory.mktemp("operator")
    namespaces = ("groups", "rollout", "refit", "gone")
    # The LeaderWorkerSet CRD is there before the operator starts, as on a cluster prepared for spanning roles
    # (the operator starting without it is tested on the fake API).
    with router.server, one_world(kubectl, workdir, namespaces) as (real, cluster, cli):
        install_crd(cli, real, LWS_CRD, "/apis/leaderworkerset.x-k8s.io/v1")
        with running_operator(cluster, cli, workdir / "operator.log", args) as operator:
            yield Env(cluster, cli, operator, router)


def deepseek(namespace: str, **roles: dict[str, Any]) -> dict[str, Any]:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"]["namespace"] = namespace
    for role, fields in roles.items():
        manifest["spec"][role].update(fields)
    return manifest


def groups(env: Env, namespace: str) -> dict[str, dict[str, Any]]:
    return {
        obj["metadata"]["name"]: obj
        for obj in env.cluster.objects(LWS)
        if obj["metadata"]["namespace"] == namespace
    }


def mark_groups_ready(env: Env, namespace: str) -> None:
    """Play the LeaderWorkerSet controller: every group updated and ready (its counts are groups)."""
    for name, obj in groups(env, namespace).items():
        replicas = obj["spec"]["replicas"]
        status = {
            "observedGeneration": obj["metadata"]["generation"],
            "replicas": replicas,
            "readyReplicas": replicas,
            "updatedReplicas": replicas,
        }
        env.kubectl.run(
            "patch", "leaderworkerset", name, "-n", namespace, "--subresource=status", "--type=merge",
            "-p", json.dumps({"status": status}),
        )  # fmt: skip


def child_writes_since(env: Env, mark: int) -> list[str]:
    return sorted(
        w for w in env.operator_writes_since(mark) if "/pdservices/" not in w and "/events" not in w
    )


def test_roles_count_ready_groups_and_nothing_is_written_at_rest(env: Env) -> None:
    apply(env, deepseek("groups", decode={"replicas": 2}))
    eventually(lambda: len(groups(env, "groups")) == 2, "two LeaderWorkerSets")
    for obj in groups(env, "groups").values():
        assert leader_worker_set_errors({k: obj[k] for k in ("apiVersion", "kind", "spec")}) == []
    mark_ready(env, "groups", "deepseek-v3")  # the router Deployment
    status = env.status("groups", "deepseek-v3")
    assert status.get("decode", {}).get("readyReplicas", 0) == 0
    mark_groups_ready(env, "groups")
    status = eventually(
        lambda: (s := env.status("groups", "deepseek-v3")).get("phase") == "Ready" and s, "phase Ready"
    )
    # groups, not pods: one prefill engine of 2 pods, two decode engines of 2 pods each
    assert status["prefill"] == {"desiredReplicas": 1, "readyReplicas": 1, "summary": "1/1"}
    assert status["decode"] == {"desiredReplicas": 2, "readyReplicas": 2, "summary": "2/2"}
    assert not any(obj["metadata"]["namespace"] == "groups" for obj in env.cluster.objects(STS))
    quiet(env)
    mark = env.request_count()
    quiet(env, 2.0)
    assert env.operator_writes_since(mark) == []


def test_scaling_and_rolling_out_patch_only_the_groups_and_the_router_config(env: Env) -> None:
    apply(env, deepseek("rollout"))
    eventually(lambda: len(groups(env, "rollout")) == 2, "two LeaderWorkerSets")
    mark_groups_ready(env, "rollout")
    mark_ready(env, "rollout", "deepseek-v3")
    eventually(lambda: env.status("rollout", "deepseek-v3").get("phase") == "Ready", "phase Ready")
    quiet(env)

    mark = env.request_count()
    env.kubectl.run(
        "patch",
        "pds",
        "deepseek-v3",
        "-n",
        "rollout",
        "--type=merge",
        "-p",
        '{"spec":{"decode":{"replicas":3}}}',
    )
    eventually(
        lambda: groups(env, "rollout")["deepseek-v3-decode"]["spec"]["replicas"] == 3, "3 decode groups"
    )
    quiet(env)
    assert child_writes_since(env, mark) == [
        "PATCH /api/v1/namespaces/rollout/configmaps/deepseek-v3-router",
        "PATCH /apis/leaderworkerset.x-k8s.io/v1/namespaces/rollout/leaderworkersets/deepseek-v3-decode",
    ]
    assert env.status("rollout", "deepseek-v3")["decode"]["summary"] == "1/3"

    mark = env.request_count()
    image = '{"spec":{"engine":{"image":"vllm/vllm-openai:v0.32.1"}}}'
    env.kubectl.run("patch", "pds", "deepseek-v3", "-n", "rollout", "--type=merge", "-p", image)
    eventually(
        lambda: all(
            g["spec"]["leaderWorkerTemplate"][t]["spec"]["containers"][0]["image"]
            == "vllm/vllm-openai:v0.32.1"
            for g in groups(env, "rollout").values()
            for t in ("leaderTemplate", "workerTemplate")
        ),
        "both roles' leaders and workers on the new image",
    )
    status = eventually(
        lambda: (s := env.status("rollout", "deepseek-v3")).get("phase") != "Ready" and s, "a rollout"
    )
    assert condition(status, "Progressing")["status"] == "True"
    mark_groups_ready(env, "rollout")
    eventually(lambda: env.status("rollout", "deepseek-v3").get("phase") == "Ready", "phase Ready again")


def test_a_role_brought_back_onto_one_node_trades_its_groups_for_a_statefulset(env: Env) -> None:
    apply(env, deepseek("refit"))
    eventually(lambda: len(groups(env, "refit")) == 2, "two LeaderWorkerSets")
    one_node = deepseek("refit")
    del one_node["spec"]["decode"]["gpusPerNode"]
    apply(env, one_node)
    eventually(lambda: set(groups(env, "refit")) == {"deepseek-v3-prefill"}, "decode's group deleted")
    sts = eventually(
        lambda: next((o for o in env.cluster.objects(STS) if o["metadata"]["namespace"] == "refit"), None),
        "decode's StatefulSet",
    )
    assert sts["metadata"]["name"] == "deepseek-v3-decode"
    assert sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 16


def test_deleting_the_pdservice_deletes_its_groups(env: Env) -> None:
    apply(env, deepseek("gone"))
    eventually(lambda: len(groups(env, "gone")) == 2, "two LeaderWorkerSets")
    env.kubectl.run("delete", "pds", "deepseek-v3", "-n", "gone", "--wait=false")
    eventually(lambda: groups(env, "gone") == {}, "the groups deleted")


def test_every_request_was_granted_and_the_leader_worker_set_verbs_are_the_ones_used(env: Env) -> None:
    attributes = {rbac_attributes(r) for r in env.cluster.requests() if is_operator_request(r)} - {None}
    assert sorted(a for a in attributes if a is not None and not is_granted(*a)) == []
    used = {verb for verb, group, _ in (a for a in attributes if a) if group == "leaderworkerset.x-k8s.io"}
    assert used == {"list", "watch", "create", "patch", "delete"}  # what pdoperator.rbac grants, no more
