"""The real operator process against a full kube-apiserver (controller-runtime's envtest convention: a folder
with ``kube-apiserver`` and ``etcd`` in ``KUBEBUILDER_ASSETS``), driven by the real kubectl.

Everything the emulator suite takes on trust is the real thing here: the CRD's schema and CEL rules,
defaulting of every child kind (the operator must not see those defaults as drift), admission (namespaces
must exist), validation of StatefulSet and Deployment status, ownerReferences, events. No controllers run:
the test plays the StatefulSet and Deployment controllers by writing their status through the ``/status``
subresource, and there is no garbage collector, so children only go away when the operator deletes them.

Without the assets (this machine) the module skips with ``assets_missing()``'s reason, which says how to run
it: ``KUBEBUILDER_ASSETS=$(setup-envtest use -p path 1.35.x) make test``.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from pdoperator.api import parse_pdservice
from pdoperator.reconcile.kinds import CHILD_KINDS, PDSERVICES, kind_of
from pdoperator.render import RenderDefaults, render_pdservice

from tests.k8s.envtest import KubeApiServer, assets_missing
from tests.k8s.fake_http import FakeHttpServer
from tests.k8s.harness import REPO_ROOT, Kubectl, OperatorProcess, eventually

SKIP_REASON = assets_missing()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

CRD = REPO_ROOT / "crds" / "pdservices.inference.pdoperator.dev.yaml"
# the CPU one every tutorial starts with, and the production-shaped one (GPUs, EFA, TP8) in its own namespace
EXAMPLES = ("tiny-cpu.yaml", "qwen3-32b-push-efa.yaml")
INSTANCE = "app.kubernetes.io/instance"
ROLE = "inference.pdoperator.dev/role"
FINALIZER = "inference.pdoperator.dev/finalizer"


def example(name: str) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load((REPO_ROOT / "examples" / name).read_text())
    return manifest


@dataclass
class Env:
    server: KubeApiServer
    kubectl: Kubectl
    operator: OperatorProcess

    def get(self, path: str) -> dict[str, Any] | None:
        status, body, _ = self.server.request("GET", path)
        if status == 404:
            return None
        assert status == 200, (path, status, body)
        result: dict[str, Any] = body
        return result

    def pds(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get(PDSERVICES.path(namespace, name))

    def status(self, namespace: str, name: str) -> dict[str, Any]:
        return (self.pds(namespace, name) or {}).get("status") or {}

    def children(self, namespace: str, name: str) -> dict[tuple[str, str], dict[str, Any]]:
        """Every object of every kind the operator manages that carries this PDService's instance label, by
        (kind, name); kinds whose CRD this server lacks (LeaderWorkerSet, ScaledObject) answer 404: none."""
        found = {}
        for kind in CHILD_KINDS:
            status, body, _ = self.server.request(
                "GET", kind.path(namespace), params={"labelSelector": f"{INSTANCE}={name}"}
            )
            if status == 404 and kind.optional:
                continue
            assert status == 200, (kind, status, body)
            for obj in body["items"]:
                found[(kind.kind, obj["metadata"]["name"])] = obj
        return found

    def events(self, namespace: str, name: str) -> list[dict[str, Any]]:
        items = (self.get(f"/api/v1/namespaces/{namespace}/events") or {}).get("items", [])
        return [e for e in items if e.get("involvedObject", {}).get("name") == name]


@pytest.fixture(scope="module")
def env(kubectl: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    workdir = tmp_path_factory.mktemp("envtest")
    # the router's /status: 404 for every PDService (no counts yet), as in the emulator suite
    with KubeApiServer(workdir / "control-plane") as server, FakeHttpServer(lambda _: None) as router:
        cli = Kubectl(kubectl, server.write_kubeconfig(workdir / "kubeconfig"))
        cli.run("apply", "-f", str(CRD))  # kubectl's default validation: strict, by the server's own schema
        cli.run("wait", "--for=condition=Established", "crd/pdservices.inference.pdoperator.dev")
        # a real server's admission wants the namespace first; ``default`` comes from a loop of the server's
        # own that may finish after /readyz
        eventually(lambda: server.request("GET", "/api/v1/namespaces/default")[0] == 200, "namespace default")
        for namespace in sorted({example(e)["metadata"]["namespace"] for e in EXAMPLES} - {"default"}):
            cli.run("create", "namespace", namespace)
        args = ["-A", "--router-status-url", router.base_url + "/{namespace}/{name}/status"]
        operator = OperatorProcess(cli.kubeconfig, workdir / "operator.log", args)
        operator.start()
        try:
            yield Env(server, cli, operator)
        finally:
            code = operator.stop()
            print(operator.log()[-6000:])
    assert code == 0, f"the operator exited with {code}"
    assert "failed with an exception" not in operator.log(), "a handler raised (see the log above)"


def rendered(pds: dict[str, Any]) -> list[dict[str, Any]]:
    """What the operator renders for this PDService as the server stores it (its defaults applied)."""
    return render_pdservice(parse_pdservice(pds), RenderDefaults())


def mark_ready(env: Env, namespace: str, name: str) -> None:
    """Play the StatefulSet and Deployment controllers: every replica of the current revision ready."""
    for (kind, child), obj in env.children(namespace, name).items():
        if kind not in ("StatefulSet", "Deployment"):
            continue
        replicas = obj["spec"].get("replicas", 1)
        status = {
            "observedGeneration": obj["metadata"]["generation"],
            "replicas": replicas,
            "readyReplicas": replicas,
            "updatedReplicas": replicas,
            "availableReplicas": replicas,
        }
        if kind == "StatefulSet":
            status |= {"currentReplicas": replicas, "currentRevision": "r1", "updateRevision": "r1"}
        patch = json.dumps({"status": status})
        env.kubectl.run(
            "patch", kind.lower(), child, "-n", namespace, "--subresource=status", "--type=merge", "-p", patch
        )


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions", []) if c["type"] == type_)


@pytest.mark.parametrize("file", EXAMPLES)
def test_an_example_gets_its_children_its_status_from_theirs_and_its_deletion_on_a_full_apiserver(
    env: Env, file: str
) -> None:
    manifest = example(file)
    namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    env.kubectl.run("apply", "-f", str(REPO_ROOT / "examples" / file))

    # ---- children: exactly what pdoperator.render makes of the stored spec, each controlled by the PDService
    pds = eventually(
        lambda: (p := env.pds(namespace, name)) and FINALIZER in p["metadata"].get("finalizers", []) and p,
        f"the operator's finalizer on {namespace}/{name}",
        timeout=60,
    )
    expected = {(m["kind"], m["metadata"]["name"]): m for m in rendered(pds)}
    for manifest in expected.values():
        kind_of(manifest)  # a kind outside CHILD_KINDS would go unseen by ``children``: fail here, by name
    children = eventually(
        lambda: (c := env.children(namespace, name)).keys() == expected.keys() and c,
        f"the {len(expected)} rendered children of {namespace}/{name}: {sorted(expected)}",
        timeout=60,
    )
    for key, child in children.items():
        assert child["metadata"]["ownerReferences"] == [
            {
                "apiVersion": PDSERVICES.api_version,
                "kind": PDSERVICES.kind,
                "name": name,
                "uid": pds["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], key
        assert child["metadata"]["labels"][INSTANCE] == name
    roles = {
        obj["metadata"]["labels"][ROLE]: obj["spec"].get("replicas", 1)
        for (kind, _), obj in children.items()
        if kind in ("StatefulSet", "Deployment")
    }
    assert set(roles) == {"prefill", "decode", "router"}
    pending = eventually(lambda: env.status(namespace, name).get("phase"), "a first status", timeout=30)
    assert pending != "Ready"  # nothing runs yet: no controller has reported a ready replica

    # ---- status from the StatefulSets' and the Deployment's status
    mark_ready(env, namespace, name)
    status = eventually(
        lambda: (s := env.status(namespace, name)).get("phase") == "Ready" and s,
        f"{namespace}/{name} Ready",
        timeout=60,
    )
    for role, replicas in roles.items():
        summary = f"{replicas}/{replicas}"
        assert status[role] == {"desiredReplicas": replicas, "readyReplicas": replicas, "summary": summary}
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "AllReplicasReady")
    assert condition(status, "SpecValid")["status"] == "True"
    assert status["observedGeneration"] == (env.pds(namespace, name) or {})["metadata"]["generation"]

    # ---- settled: the server's defaults in every child are no drift to the operator
    time.sleep(1)  # the operator's answers to the status writes above, if any, land first
    versions = {k: c["metadata"]["resourceVersion"] for k, c in env.children(namespace, name).items()}
    time.sleep(3)
    after = {k: c["metadata"]["resourceVersion"] for k, c in env.children(namespace, name).items()}
    assert after == versions, "the operator keeps rewriting children the server has defaulted"

    # ---- deletion: the delete handler removes the children itself (no garbage collector here), then the
    # finalizer, and the PDService is gone
    env.kubectl.run("delete", "-f", str(REPO_ROOT / "examples" / file), "--timeout=60s", timeout=90)
    assert env.pds(namespace, name) is None
    eventually(lambda: env.children(namespace, name) == {}, "every child deleted by the operator", timeout=30)
    eventually(
        lambda: any(e["reason"] == "ChildrenDeleted" for e in env.events(namespace, name)),
        "a ChildrenDeleted event",
        timeout=30,
    )
