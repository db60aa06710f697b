"""The Kubernetes permissions the operator needs: exactly the API calls it makes, as data.

The Helm chart renders these rules (``charts/pd-operator/files/rbac-rules.yaml`` is generated
from ``rbac_rules_document()``); the integration tests record every request the operator makes
against the API emulator and fail on any call these rules do not grant.

``cluster`` rules are cluster-scoped resources (ClusterRole in every mode); ``namespaced`` rules
go into a Role per watched namespace, or into the ClusterRole with ``--all-namespaces``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdoperator.api.model import GROUP, PLURAL

READ = ("get", "list", "watch")
# the reconciler lists by label, kopf watches
MANAGE_CHILDREN = ("list", "watch", "create", "patch", "delete")
MANAGE_UNWATCHED_CHILDREN = ("list", "create", "patch", "delete")


@dataclass(frozen=True)
class Rule:
    api_group: str
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    why: str

    def grants(self, verb: str, api_group: str, resource: str) -> bool:
        return api_group == self.api_group and resource in self.resources and verb in self.verbs

    def as_policy_rule(self) -> dict[str, Any]:
        return {"apiGroups": [self.api_group], "resources": list(self.resources), "verbs": list(self.verbs)}


CLUSTER_RULES: tuple[Rule, ...] = (
    Rule(
        "apiextensions.k8s.io",
        ("customresourcedefinitions",),
        READ,
        "kopf discovers and watches the PDService CRD",
    ),
    Rule("", ("namespaces",), READ, "kopf follows the watched namespaces (with --namespace)"),
    Rule(
        "kopf.dev",
        ("clusterkopfpeerings",),
        (*READ, "patch"),
        "kopf peering between replicas (with --all-namespaces --peering)",
    ),
)

NAMESPACED_RULES: tuple[Rule, ...] = (
    Rule(
        GROUP,
        (PLURAL,),
        (*READ, "patch"),
        "kopf watches PDServices and keeps its finalizer and progress annotations",
    ),
    Rule(GROUP, (f"{PLURAL}/status",), ("get", "patch"), "the reconciler writes the status"),
    Rule(
        "apps",
        ("statefulsets", "deployments"),
        MANAGE_CHILDREN,
        "prefill/decode StatefulSets, router Deployment",
    ),
    Rule(
        "leaderworkerset.x-k8s.io",
        ("leaderworkersets",),
        MANAGE_CHILDREN,
        "prefill/decode LeaderWorkerSets, where an engine spans nodes (the LWS controller's CRD)",
    ),
    Rule("", ("services", "configmaps"), MANAGE_CHILDREN, "headless and router Services, router ConfigMap"),
    Rule("networking.k8s.io", ("networkpolicies",), MANAGE_UNWATCHED_CHILDREN, "side-channel NetworkPolicy"),
    Rule("policy", ("poddisruptionbudgets",), MANAGE_UNWATCHED_CHILDREN, "PodDisruptionBudgets"),
    Rule(
        "autoscaling",
        ("horizontalpodautoscalers",),
        MANAGE_UNWATCHED_CHILDREN,
        "per-role HorizontalPodAutoscalers (spec.autoscaling.engine hpa)",
    ),
    Rule(
        "keda.sh",
        ("scaledobjects",),
        MANAGE_UNWATCHED_CHILDREN,
        "per-role KEDA ScaledObjects (spec.autoscaling.engine keda)",
    ),
    Rule("", ("events",), ("create",), "events about PDServices"),
    Rule(
        "kopf.dev",
        ("kopfpeerings",),
        (*READ, "patch"),
        "kopf peering between replicas (with --namespace --peering)",
    ),
)


def rbac_rules_document() -> dict[str, list[dict[str, Any]]]:
    """The document the Helm chart renders its (Cluster)Roles from."""
    return {
        "cluster": [rule.as_policy_rule() for rule in CLUSTER_RULES],
        "namespaced": [rule.as_policy_rule() for rule in NAMESPACED_RULES],
    }


def is_granted(verb: str, api_group: str, resource: str) -> bool:
    """Whether the rules allow ``verb`` on ``resource`` (``plural`` or ``plural/subresource``) of
    ``api_group``."""
    return any(rule.grants(verb, api_group, resource) for rule in (*CLUSTER_RULES, *NAMESPACED_RULES))
