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

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> RenderDefaults:
        """Defaults overridden by the operator's environment (``ENVIRONMENT``); empty values are ignored."""
        overrides = {name: environ[var] for name, var in ENVIRONMENT.items() if environ.get(var)}
        return cls(**overrides)
