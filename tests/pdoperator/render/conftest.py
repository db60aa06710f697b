"""PDServices to render: the repository's examples and variants that cover the other branches."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from pdoperator.api.model import PDService, PDServiceSpec
from pdoperator.render import RenderDefaults

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "examples"
EXAMPLE_NAMES = sorted(path.stem for path in EXAMPLES.glob("*.yaml"))

# A GPU service without EFA: the base the variants edit.
GPU_SPEC: dict[str, Any] = {
    "mode": "push",
    "model": {"name": "Qwen/Qwen3-8B", "servedName": "qwen3-8b", "dtype": "bfloat16", "maxModelLen": 8192},
    "prefill": {"replicas": 2, "tensorParallelSize": 2},
    "decode": {"replicas": 3, "tensorParallelSize": 2},
    "engine": {"image": "ghcr.io/pd-operator/pd-engine:0.1.0"},
}


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``base`` with ``patch`` merged in (mappings recursively, everything else replaced)."""
    result = copy.deepcopy(base)
    for key, value in patch.items():
        result[key] = (
            merge(result[key], value)
            if isinstance(value, dict) and isinstance(result.get(key), dict)
            else copy.deepcopy(value)
        )
    return result


VARIANTS: dict[str, dict[str, Any]] = {
    "gpu-push-ucx": GPU_SPEC,
    "gpu-pull": merge(GPU_SPEC, {"mode": "pull"}),
    "upstream-push": merge(
        GPU_SPEC,
        {
            "engine": {
                "connector": "vllm",
                "prefillEngineId": "prefill-fixed",
                "image": "vllm/vllm-openai:v0.32.0",
            }
        },
    ),
    "upstream-pull": merge(
        GPU_SPEC, {"mode": "pull", "engine": {"connector": "vllm", "image": "vllm/vllm-openai:v0.32.0"}}
    ),
    "pvc-source": merge(
        GPU_SPEC, {"model": {"source": {"pvc": {"claimName": "weights", "path": "qwen3-8b"}}}}
    ),
    "efa-privileged": merge(
        GPU_SPEC,
        {
            "prefill": {
                "resources": {"memory": "512Gi"},
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                            ]
                        }
                    }
                },
            },
            "decode": {"resources": {"memory": "512Gi"}},
            "engine": {"transport": {"backend": "LIBFABRIC"}},
            "network": {
                "efa": {"enabled": True, "prefillDevices": 4, "decodeDevices": 2, "privileged": True}
            },
        },
    ),
    "hybrid-gdn": merge(
        GPU_SPEC,
        {
            "model": {"architecture": "hybrid-ssm"},
            "ssm": {"family": "gdn", "convStateLayout": "DS"},
            "decode": {"tensorParallelSize": 4},
        },
    ),
    "api-key-cpu": merge(
        GPU_SPEC,
        {
            "prefill": {
                "resources": {"gpus": 0, "cpu": "4", "memory": "8Gi"},
                "extraArgs": ["--block-size", "16"],
                "env": [{"name": "X", "value": "1"}],
            },
            "decode": {"resources": {"gpus": 0}, "enablePrefixCaching": True},
            "router": {
                "apiKeySecretRef": {"name": "router-key", "key": "token"},
                "port": 80,
                "policy": "round-robin",
                "replicas": 0,
            },
        },
    ),
    "cache-aware": merge(
        GPU_SPEC,
        {
            "prefill": {"env": [{"name": "PYTHONHASHSEED", "value": "42"}]},
            "decode": {"env": [{"name": "PYTHONHASHSEED", "value": "42"}]},
            "router": {"policy": "cache-aware", "cacheAware": {"blockSize": 32, "maxImbalance": 2}},
        },
    ),
    # Decode engines of TP 4 over two nodes of 2 GPUs, with the builtin connector.
    "spanning-nodes": merge(GPU_SPEC, {"decode": {"tensorParallelSize": 4, "gpusPerNode": 2}}),
    "autoscaled-hpa": merge(
        GPU_SPEC,
        {
            "autoscaling": {
                "engine": "hpa",
                "prefill": {"minReplicas": 1, "maxReplicas": 4},
                "decode": {"minReplicas": 2, "maxReplicas": 8},
                "targets": {"waitingRequestsPerPrefill": 4, "runningRequestsPerDecode": 32},
                "scaleUpWindowSeconds": 15,
                "scaleDownWindowSeconds": 600,
            }
        },
    ),
    "autoscaled-keda": merge(
        GPU_SPEC,
        {
            "autoscaling": {
                "engine": "keda",
                "prefill": {"minReplicas": 0, "maxReplicas": 4},
                "decode": {"minReplicas": 1, "maxReplicas": 8},
                "targets": {
                    "percentile": 95,
                    "ttftMilliseconds": 800,
                    "tpotMilliseconds": 40,
                    "waitingRequestsPerPrefill": 4,
                },
                "prometheus": {"serverAddress": "http://prometheus.monitoring.svc:9090"},
            }
        },
    ),
}


def pds_from_document(doc: dict[str, Any]) -> PDService:
    meta = doc["metadata"]
    return PDService(
        name=meta["name"],
        namespace=meta.get("namespace", "default"),
        spec=PDServiceSpec.model_validate(doc["spec"]),
    )


def load_example(name: str) -> PDService:
    return pds_from_document(yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()))


def pds_from_spec(spec: dict[str, Any], name: str = "svc", namespace: str = "ml") -> PDService:
    return PDService(name=name, namespace=namespace, spec=PDServiceSpec.model_validate(spec))


@pytest.fixture
def defaults() -> RenderDefaults:
    return RenderDefaults()


@pytest.fixture
def make_pds() -> Callable[..., PDService]:
    """``make_pds(patch)``: the GPU base spec with ``patch`` merged in."""

    def make(patch: dict[str, Any] | None = None, name: str = "svc", namespace: str = "ml") -> PDService:
        return pds_from_spec(merge(GPU_SPEC, patch or {}), name=name, namespace=namespace)

    return make


@pytest.fixture(params=EXAMPLE_NAMES)
def example(request: pytest.FixtureRequest) -> tuple[str, PDService]:
    """(name, PDService) of every file in examples/."""
    return request.param, load_example(request.param)


@pytest.fixture(params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest) -> tuple[str, PDService]:
    """(name, PDService) of every variant spec."""
    return request.param, pds_from_spec(VARIANTS[request.param])


@pytest.fixture
def example_pds() -> Callable[[str], PDService]:
    """``example_pds(name)``: the PDService of ``examples/<name>.yaml``."""
    return load_example
