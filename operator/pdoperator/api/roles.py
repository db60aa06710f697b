"""One engine role of a PDService (prefill or decode): replicas, parallel layout, resources, scheduling.

An engine is ``tensorParallelSize x pipelineParallelSize`` ranks, one GPU each. With ``gpusPerNode`` set
below that, one engine spans several pods on as many nodes (``nodes``): a LeaderWorkerSet group whose
leader runs vLLM's API server and whose workers join it headless. Without it every engine is one pod.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from pdoperator.api.base import ENV_VAR_NAME, QUANTITY, ApiModel

# The largest integer bound the API server takes: it reads a schema's maximum as a JSON number and refuses one
# beyond 2^53 ("Maximum boundary value must be of type integer"), failing every object that sets the field.
MAX_JSON_INTEGER = 2**53 - 1


class Toleration(ApiModel):
    """A Kubernetes toleration (core/v1 Toleration)."""

    key: Annotated[str | None, Field(description="Taint key the toleration applies to.")] = None
    operator: Annotated[
        Literal["Exists", "Equal"] | None,
        Field(description="Exists matches any value of the key; Equal (the default) matches value."),
    ] = None
    value: Annotated[str | None, Field(description="Taint value the toleration matches.")] = None
    effect: Annotated[
        Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None,
        Field(description="Taint effect to match; unset matches all effects."),
    ] = None
    toleration_seconds: Annotated[
        # Unbounded, pdctl took numbers beyond int64 that the API server refuses.
        int | None,
        Field(description="How long a NoExecute taint is tolerated.", ge=0, le=MAX_JSON_INTEGER),
    ] = None


class EnvVar(ApiModel):
    """An environment variable with a literal value (core/v1 EnvVar without valueFrom)."""

    name: Annotated[
        str, Field(description="Variable name.", min_length=1, max_length=256, pattern=ENV_VAR_NAME)
    ]
    value: Annotated[str, Field(description="Variable value.", max_length=32768)] = ""


class RoleResources(ApiModel):
    """Compute resources of one engine pod."""

    gpus: Annotated[
        int | None,
        Field(
            description="nvidia.com/gpu per pod; defaults to the ranks one pod runs (tensorParallelSize x "
            "pipelineParallelSize, over the nodes an engine spans). 0 for CPU or mock engines.",
            ge=0,
            le=64,
        ),
    ] = None
    cpu: Annotated[
        str | None, Field(description="CPU request and limit (Kubernetes quantity).", pattern=QUANTITY)
    ] = None
    memory: Annotated[
        str | None, Field(description="Memory request and limit (Kubernetes quantity).", pattern=QUANTITY)
    ] = None
    shm_size: Annotated[
        str,
        Field(
            description="Size of the memory-backed /dev/shm volume (NCCL and NIXL need more than the "
            "default 64Mi).",
            pattern=QUANTITY,
        ),
    ] = "16Gi"


class RoleSpec(ApiModel):
    """One role of the disaggregated service: prefill or decode engines."""

    replicas: Annotated[
        int,
        Field(
            description="Number of engines of this role (pods, or pod groups where engines span nodes).",
            ge=0,
            le=1024,
        ),
    ] = 1
    tensor_parallel_size: Annotated[
        int,
        Field(description="Tensor-parallel size of each engine (vLLM --tensor-parallel-size).", ge=1, le=64),
    ] = 1
    pipeline_parallel_size: Annotated[
        int,
        Field(
            description="Pipeline-parallel size of each engine (vLLM --pipeline-parallel-size). Above 1 only "
            "with spec.engine.connector vllm: the builtin connector pairs tensor-parallel ranks that hold "
            "every layer.",
            ge=1,
            le=64,
        ),
    ] = 1
    gpus_per_node: Annotated[
        int | None,
        Field(
            description="GPUs one node gives an engine pod (the node type's GPU count). An engine of more "
            "ranks (tensorParallelSize x pipelineParallelSize) spans ranks / gpusPerNode pods on as many "
            "nodes, run as a LeaderWorkerSet group (the LeaderWorkerSet controller must be installed); "
            "unset: every engine is one pod.",
            ge=1,
            le=64,
        ),
    ] = None
    enable_expert_parallel: Annotated[
        bool,
        Field(
            description="Shard a mixture-of-experts model's experts over the engine's ranks instead of "
            "slicing every expert (vLLM --enable-expert-parallel); attention and its KV cache stay "
            "tensor-parallel."
        ),
    ] = False
    resources: Annotated[RoleResources, Field(description="Compute resources of each pod.")] = Field(
        default_factory=RoleResources
    )
    max_num_seqs: Annotated[
        int | None,
        Field(description="Maximum concurrent sequences per engine (vLLM --max-num-seqs).", ge=1, le=65536),
    ] = None
    enable_prefix_caching: Annotated[
        bool | None,
        Field(
            description="Prefix caching on this role; unset lets the operator choose (off on both roles for "
            "hybrid models, which reject true)."
        ),
    ] = None
    node_selector: Annotated[
        dict[str, Annotated[str, Field(description="Label value the node must carry under this key.")]],
        Field(description="Node labels the pods must match."),
    ] = Field(default_factory=dict)
    tolerations: Annotated[list[Toleration], Field(description="Tolerations of the pods.", max_length=64)] = (
        Field(default_factory=list)
    )
    affinity: Annotated[
        dict[str, Any] | None,
        Field(
            description="Pod affinity (core/v1 Affinity); merged with the prefill/decode host anti-affinity "
            "the operator adds when EFA is on.",
            json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
        ),
    ] = None
    extra_args: Annotated[
        list[Annotated[str, Field(description="One command-line argument.", max_length=4096)]],
        Field(
            description="Extra command-line arguments appended to the engine's command line; flags the "
            "operator sets from the spec are rejected.",
            max_length=128,
        ),
    ] = Field(default_factory=list)
    env: Annotated[
        list[EnvVar],
        Field(
            description="Extra environment variables of the engine container; names the operator sets are "
            "rejected.",
            max_length=128,
            json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        ),
    ] = Field(default_factory=list)
    image: Annotated[
        str | None,
        Field(
            description="Engine image for this role; overrides spec.engine.image.",
            min_length=1,
            max_length=512,
        ),
    ] = None

    @property
    def world_size(self) -> int:
        """Ranks (GPUs) of one engine."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def spans_nodes(self) -> bool:
        """One engine needs more GPUs than a node gives it."""
        return self.gpus_per_node is not None and self.world_size > self.gpus_per_node

    @property
    def nodes(self) -> int:
        """Pods (on as many nodes) one engine spans; validation makes gpusPerNode divide the world size."""
        return self.world_size // self.gpus_per_node if self.spans_nodes and self.gpus_per_node else 1
