"""The engine LeaderWorkerSet of a role whose engines span nodes: one group of pods per engine.

LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``, kubernetes-sigs/lws) is a controller the user installs.
Group ``i`` is the leader ``<name>-<role>-<i>``, named and addressed as a StatefulSet pod would be, so the
router's backends and the engines' ids keep their form, and workers ``<name>-<role>-<i>-<j>``. A worker
that dies restarts its whole group (a vLLM engine cannot take a rank back), and a group's ranks all carry
its leader's engine id.
"""

from __future__ import annotations

from typing import Any

from pdoperator.api.model import PDService

from .defaults import RenderDefaults
from .engine import EnginePod, render_engine_pod_template
from .identity import role_spec
from .names import ComponentRole, object_meta

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"


def render_engine_leader_worker_set(
    pds: PDService, role: ComponentRole, defaults: RenderDefaults
) -> dict[str, Any]:
    rs = role_spec(pds.spec, role)
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": object_meta(pds, role),
        "spec": {
            "replicas": rs.replicas,
            # Workers start with their leader, not once it is ready: vLLM's leader is ready only when every
            # rank has joined it.
            "startupPolicy": "LeaderCreated",
            # One group at a time, none above the count: a group is a node's worth of GPUs or more.
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
            # Pods resolve as <pod>.<governing Service>, the engines' headless Service of this name.
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": rs.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": render_engine_pod_template(pds, role, defaults, EnginePod.LEADER),
                "workerTemplate": render_engine_pod_template(pds, role, defaults, EnginePod.WORKER),
            },
        },
    }


def leader_worker_set_pod_templates(group: dict[str, Any]) -> list[dict[str, Any]]:
    """A rendered LeaderWorkerSet's leader and worker pod templates as core/v1 PodTemplates, for the checks
    that know Kubernetes' own kinds only."""
    templates = group["spec"]["leaderWorkerTemplate"]
    return [
        {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {
                "name": f"{group['metadata']['name']}-{which}",
                "namespace": group["metadata"]["namespace"],
            },
            "template": templates[f"{which}Template"],
        }
        for which in ("leader", "worker")
    ]
