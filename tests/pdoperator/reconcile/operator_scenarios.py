"""What the scenarios of the operator in the one world share (``test_operator_against_emulator.py`` and
``test_multinode_against_emulator.py``): the module's environment, a fake router status endpoint, tiny
PDServices, and playing the StatefulSet and Deployment controllers."""

from __future__ import annotations

import json
import pathlib
import time
from dataclasses import dataclass
from typing import Any

import yaml
from pdoperator.api import parse_pdservice
from pdoperator.render import RenderDefaults, render_pdservice

from tests.k8s.fake_http import FakeHttpServer
from tests.k8s.harness import Kubectl, OperatorProcess, eventually, writes_by_operator
from tests.k8s.server import EmulatedCluster

REPO = pathlib.Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "tiny-cpu.yaml"
PDS = "inference.pdoperator.dev/v1alpha1/pdservices"
STS = "apps/v1/statefulsets"
DEPLOY = "apps/v1/deployments"
CM = "v1/configmaps"
CHILD_RESOURCES = (
    STS,
    DEPLOY,
    "v1/services",
    CM,
    "networking.k8s.io/v1/networkpolicies",
    "policy/v1/poddisruptionbudgets",
)


class FakeRouterStatus:
    """Serves ``GET /<namespace>/<name>/status`` like the router does; PDServices without counts get 404."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], tuple[int, int]] = {}
        self.server = FakeHttpServer(self.answer)

    def answer(self, path: str) -> tuple[str, str] | None:
        parts = path.strip("/").split("/")
        key = (parts[0], parts[1]) if len(parts) == 3 else ("", "")
        if key not in self.counts:
            return None
        verified, unverified = self.counts[key]
        transfers = {"verified": verified, "unverified": unverified}
        return "application/json", json.dumps({"mode": "push", "transfers": transfers})

    @property
    def url_template(self) -> str:
        return self.server.base_url + "/{namespace}/{name}/status"


@dataclass
class Env:
    cluster: EmulatedCluster
    kubectl: Kubectl
    operator: OperatorProcess
    router: FakeRouterStatus

    def pds(self, namespace: str, name: str) -> dict[str, Any]:
        obj = self.cluster.get(PDS, namespace, name)
        assert obj is not None, f"PDService {namespace}/{name} is gone"
        return obj

    def status(self, namespace: str, name: str) -> dict[str, Any]:
        return self.pds(namespace, name).get("status") or {}

    def children(self, namespace: str, instance: str) -> dict[tuple[str, str], dict[str, Any]]:
        found = {}
        for resource in CHILD_RESOURCES:
            for obj in self.cluster.objects(resource):
                meta = obj["metadata"]
                if (
                    meta.get("namespace") == namespace
                    and (meta.get("labels") or {}).get("app.kubernetes.io/instance") == instance
                ):
                    found[(resource, meta["name"])] = obj
        return found

    def events(self, namespace: str, name: str) -> list[dict[str, Any]]:
        return [
            e
            for e in self.cluster.objects("v1/events")
            if e.get("involvedObject", {}).get("name") == name and e["metadata"]["namespace"] == namespace
        ]

    def operator_writes_since(self, index: int) -> list[str]:
        return writes_by_operator(self.cluster.requests()[index:])

    def request_count(self) -> int:
        return len(self.cluster.requests())


def tiny(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"] = {"name": name, "namespace": namespace}
    for path, value in spec.items():
        node = manifest["spec"]
        keys = path.split("__")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return manifest


def apply(env: Env, manifest: dict[str, Any]) -> None:
    env.kubectl.apply(yaml.safe_dump(manifest))


def wait_children(env: Env, namespace: str, name: str) -> dict[tuple[str, str], dict[str, Any]]:
    """Every rendered child exists (and carries this PDService's current generation of rendering)."""
    pds = eventually(lambda: env.cluster.get(PDS, namespace, name), f"PDService {namespace}/{name}")
    count = len(render_pdservice(parse_pdservice(pds), RenderDefaults()))
    return eventually(
        lambda: (c := env.children(namespace, name)) and len(c) == count and c,
        f"{count} children of {namespace}/{name}",
    )


def mark_ready(env: Env, namespace: str, name: str) -> None:
    """Play the StatefulSet and Deployment controllers: every replica updated and ready."""
    for resource, kind in ((STS, "statefulset"), (DEPLOY, "deployment")):
        for obj in env.cluster.objects(resource):
            meta = obj["metadata"]
            if meta["namespace"] != namespace or meta["labels"].get("app.kubernetes.io/instance") != name:
                continue
            replicas = obj["spec"].get("replicas", 1)
            status = {
                "observedGeneration": meta["generation"],
                "replicas": replicas,
                "readyReplicas": replicas,
                "updatedReplicas": replicas,
            }
            if kind == "statefulset":
                status |= {"currentRevision": "rev", "updateRevision": "rev", "availableReplicas": replicas}
            else:
                status |= {"availableReplicas": replicas}
            patch = json.dumps({"status": status})
            env.kubectl.run(
                "patch",
                kind,
                meta["name"],
                "-n",
                namespace,
                "--subresource=status",
                "--type=merge",
                "-p",
                patch,
            )


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions", []) if c["type"] == type_)


def quiet(env: Env, seconds: float = 1.0) -> None:
    """Let in-flight reconciliations finish (the operator reacts within milliseconds here)."""
    time.sleep(seconds)


def kind_of(resource: str) -> str:
    return {
        STS: "StatefulSet",
        DEPLOY: "Deployment",
        "v1/services": "Service",
        CM: "ConfigMap",
        "networking.k8s.io/v1/networkpolicies": "NetworkPolicy",
        "policy/v1/poddisruptionbudgets": "PodDisruptionBudget",
    }[resource]
