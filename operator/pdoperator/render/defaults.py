"""Settings of rendering that come from the operator's installation, not from a PDService."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import version

from pdconnector.router.config import DEFAULT_MAX_REQUEST_BODY_BYTES

OPERATOR_VERSION = version("pd-operator")
IMAGE_REGISTRY = "ghcr.io/pd-operator"
OPERATOR_IMAGE = f"{IMAGE_REGISTRY}/pd-operator:{OPERATOR_VERSION}"
ENGINE_IMAGE = f"{IMAGE_REGISTRY}/pd-engine:{OPERATOR_VERSION}"

# Environment variables through which the Helm chart configures the operator's defaults.
ENVIRONMENT = {
    "router_image": "PD_OPERATOR_ROUTER_IMAGE",
    "mock_engine_image": "PD_OPERATOR_MOCK_ENGINE_IMAGE",
    "engine_image": "PD_OPERATOR_ENGINE_IMAGE",
    "cluster_domain": "PD_OPERATOR_CLUSTER_DOMAIN",
    "operator_namespace": "POD_NAMESPACE",
    "operator_pod_labels": "PD_OPERATOR_POD_LABELS",
}


@dataclass(frozen=True)
class RenderDefaults:
    """Installation-wide inputs of ``render_pdservice``; every field has a production default.

    The router and the mock engine ship in the operator image, so an operator renders
    routers of its own version unless a PDService names another router image. The engine
    image (vLLM + NIXL + pdconnector) is used by roles whose spec names no image.
    """

    router_image: str = OPERATOR_IMAGE
    mock_engine_image: str = OPERATOR_IMAGE
    engine_image: str = ENGINE_IMAGE
    cluster_domain: str = "cluster.local"
    # Model download plus weight loading of a large model can take many minutes: the
    # startup probe tolerates this long before the kubelet restarts the engine.
    engine_startup_budget_seconds: int = 1800
    # LD_LIBRARY_PATH of engine containers with EFA: the EFA libfabric first, then the
    # CUDA image's own entries (a container env value replaces the image's, it cannot extend it).
    efa_library_path: str = (
        "/opt/amazon/efa/lib:/opt/amazon/openmpi/lib:/usr/local/nvidia/lib:/usr/local/nvidia/lib64"
    )
    huggingface_cache_dir: str = "/var/cache/huggingface"
    router_cpu_request: str = "250m"
    router_memory_request: str = "256Mi"
    router_memory_limit: str = "1Gi"
    router_connect_timeout_seconds: float = 5.0
    router_prefill_timeout_seconds: float = 120.0
    router_decode_first_token_timeout_seconds: float = 60.0
    router_max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # Where the operator's own pods run and the labels they carry ("k=v,k=v"): the engines' NetworkPolicy
    # admits them to the HTTP port when the autoscaler reads the engines' /metrics. Unset: not admitted.
    operator_namespace: str = ""
    operator_pod_labels: str = ""

    def operator_pods(self) -> dict[str, str] | None:
        """The operator's pod labels as a map; None when its namespace or labels are unknown."""
        if not self.operator_namespace or not self.operator_pod_labels:
            return None
        labels = {}
        for item in self.operator_pod_labels.split(","):
            key, sep, value = item.strip().partition("=")
            if not sep or not key:
                variable = ENVIRONMENT["operator_pod_labels"]
                raise ValueError(f"{variable}={self.operator_pod_labels!r}: expected k=v[,k=v...]")
            labels[key] = value
        return labels

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> RenderDefaults:
        """Defaults overridden by the operator's environment (``ENVIRONMENT``); empty values are ignored."""
        overrides = {name: environ[var] for name, var in ENVIRONMENT.items() if environ.get(var)}
        return cls(**overrides)
