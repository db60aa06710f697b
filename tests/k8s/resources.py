"""The resources the emulator serves itself: the built-in kinds the operator and kubectl touch, grouped by
the API groups the real CRD-serving server lacks (with an upstream, every other group is forwarded)."""

from __future__ import annotations

import kmock

STATUS_SUBRESOURCE = "status"
# The groups the real CRD-serving server cannot serve; with an upstream, everything else goes there.
EMULATED_GROUPS = frozenset(
    {
        "",
        "apps",
        "autoscaling",
        "policy",
        "networking.k8s.io",
        "discovery.k8s.io",
        "events.k8s.io",
        "coordination.k8s.io",
        "rbac.authorization.k8s.io",
    }
)
# Namespaces every cluster starts with.
INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")

# Built-in resources the operator and kubectl touch: (group/version/plural, kind, namespaced, subresources,
# short names).
BUILTINS: tuple[tuple[str, str, bool, tuple[str, ...], tuple[str, ...]], ...] = (
    ("v1/namespaces", "Namespace", False, ("status",), ("ns",)),
    ("v1/configmaps", "ConfigMap", True, (), ("cm",)),
    ("v1/secrets", "Secret", True, (), ()),
    ("v1/services", "Service", True, ("status",), ("svc",)),
    ("v1/endpoints", "Endpoints", True, (), ("ep",)),
    ("v1/pods", "Pod", True, ("status",), ("po",)),
    ("v1/events", "Event", True, (), ("ev",)),
    ("v1/serviceaccounts", "ServiceAccount", True, (), ("sa",)),
    ("apps/v1/statefulsets", "StatefulSet", True, ("status", "scale"), ("sts",)),
    ("apps/v1/deployments", "Deployment", True, ("status", "scale"), ("deploy",)),
    ("autoscaling/v2/horizontalpodautoscalers", "HorizontalPodAutoscaler", True, ("status",), ("hpa",)),
    ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", True, ("status",), ("pdb",)),
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True, (), ("netpol",)),
    ("discovery.k8s.io/v1/endpointslices", "EndpointSlice", True, (), ()),
    ("events.k8s.io/v1/events", "Event", True, (), ("ev",)),
    ("coordination.k8s.io/v1/leases", "Lease", True, (), ()),
    (
        "apiextensions.k8s.io/v1/customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        ("status",),
        ("crd", "crds"),
    ),
    ("rbac.authorization.k8s.io/v1/roles", "Role", True, (), ()),
    ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding", True, (), ()),
    ("rbac.authorization.k8s.io/v1/clusterroles", "ClusterRole", False, (), ()),
    ("rbac.authorization.k8s.io/v1/clusterrolebindings", "ClusterRoleBinding", False, (), ()),
)
VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NAMESPACES = kmock.resource("", "v1", "namespaces")
# generateName suffixes: the real server's alphabet (no vowels, no look-alikes), five characters.
NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
