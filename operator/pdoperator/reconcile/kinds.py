"""The Kubernetes resources the operator reads and writes, addressed by group/version/plural."""

from __future__ import annotations

from dataclasses import dataclass

from pdoperator.api.model import GROUP, KIND, PLURAL, VERSION


@dataclass(frozen=True)
class ResourceKind:
    group: str
    version: str
    plural: str
    kind: str
    # a kind from a CRD the cluster may lack (KEDA's, LeaderWorkerSet's): listing it there answers 404, read
    # as no objects; ``missing`` tells the user what to do when a PDService needs it
    optional: bool = False
    missing: str = ""

    def absent_message(self) -> str:
        return f"this cluster serves no {self.kind} ({self.api_version}): {self.missing}"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        """The REST path of a collection, an object or one of its subresources."""
        root = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        path = f"{root}/namespaces/{namespace}/{self.plural}"
        if name is not None:
            path += f"/{name}"
            if subresource is not None:
                path += f"/{subresource}"
        return path


PDSERVICES = ResourceKind(GROUP, VERSION, PLURAL, KIND)
STATEFULSETS = ResourceKind("apps", "v1", "statefulsets", "StatefulSet")
DEPLOYMENTS = ResourceKind("apps", "v1", "deployments", "Deployment")
SERVICES = ResourceKind("", "v1", "services", "Service")
CONFIGMAPS = ResourceKind("", "v1", "configmaps", "ConfigMap")
NETWORKPOLICIES = ResourceKind("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy")
PODDISRUPTIONBUDGETS = ResourceKind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
HORIZONTALPODAUTOSCALERS = ResourceKind(
    "autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler"
)
SCALEDOBJECTS = ResourceKind(
    "keda.sh",
    "v1alpha1",
    "scaledobjects",
    "ScaledObject",
    optional=True,
    missing="install KEDA or choose another spec.autoscaling.engine",
)
LEADERWORKERSETS = ResourceKind(
    "leaderworkerset.x-k8s.io",
    "v1",
    "leaderworkersets",
    "LeaderWorkerSet",
    optional=True,
    missing="install the LeaderWorkerSet controller (kubernetes-sigs/lws, v0.10.0 or later), which runs the "
    "engines that span nodes (spec.prefill/decode.gpusPerNode below the engine's GPUs)",
)

# Every kind of child a PDService owns: the operator lists, creates, patches and deletes these.
CHILD_KINDS: tuple[ResourceKind, ...] = (
    NETWORKPOLICIES,
    PODDISRUPTIONBUDGETS,
    CONFIGMAPS,
    SERVICES,
    DEPLOYMENTS,
    STATEFULSETS,
    LEADERWORKERSETS,
    HORIZONTALPODAUTOSCALERS,
    SCALEDOBJECTS,
)
# Children whose spec or content the operator restores when edited or deleted by hand (watched by label).
WATCHED_CHILD_KINDS: tuple[ResourceKind, ...] = (
    STATEFULSETS,
    LEADERWORKERSETS,
    DEPLOYMENTS,
    SERVICES,
    CONFIGMAPS,
)

_BY_TYPE = {(k.api_version, k.kind): k for k in CHILD_KINDS}


class UnknownKindError(ValueError):
    pass


def kind_of(manifest: dict[str, object]) -> ResourceKind:
    """The resource of a rendered manifest, from its apiVersion and kind."""
    key = (str(manifest.get("apiVersion")), str(manifest.get("kind")))
    if key not in _BY_TYPE:
        raise UnknownKindError(f"the operator does not manage {key[1]} ({key[0]})")
    return _BY_TYPE[key]
