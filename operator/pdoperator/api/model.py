"""The PDService spec and status: the one source of truth for the API.

Everything else about the API is derived from these models: the CRD's OpenAPI
schema (``pdoperator.api.schema``), defaulting, and the structural half of
validation. Every field carries a description because ``kubectl explain`` shows
it to users. Field names are camelCase on the wire (Kubernetes convention) and
snake_case in Python.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

# The data plane defines what travels between the planes; the API names the same types.
from pdconnector.layout.model import ConvLayout, SsmFamily
from pdconnector.protocol.params import TransferMode
from pydantic import BaseModel, ConfigDict, Field

from pdoperator.api.autoscaling import AutoscalingSpec
from pdoperator.api.base import DNS_SUBDOMAIN, QUANTITY, SECRET_KEY, ApiModel
from pdoperator.api.kv_cache import KVCacheSpec
from pdoperator.api.roles import RoleSpec
from pdoperator.api.routing import CacheAwareSpec, RetriesSpec, RoutingPolicy

GROUP = "inference.pdoperator.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "PDService"
PLURAL = "pdservices"
SINGULAR = "pdservice"
SHORT_NAMES = ("pds",)

DEFAULT_SIDE_CHANNEL_PORT = 5600
DEFAULT_ENGINE_PORT = 8000
DEFAULT_ROUTER_PORT = 8000


# ---------------------------------------------------------------- enums


class Architecture(StrEnum):
    DENSE = "dense"
    HYBRID_SSM = "hybrid-ssm"
    MLA = "mla"


# What a stopping vLLM engine keeps of its termination grace period to release its GPU memory and exit after
# the requests in flight drained.
ENGINE_TEARDOWN_SECONDS = 10


class DType(StrEnum):
    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class Runtime(StrEnum):
    VLLM = "vllm"
    MOCK = "mock"


class ConnectorImpl(StrEnum):
    BUILTIN = "builtin"
    VLLM = "vllm"


class TransportBackend(StrEnum):
    LIBFABRIC = "LIBFABRIC"
    UCX = "UCX"
    MOCK = "mock"


class KVLoadFailurePolicy(StrEnum):
    FAIL = "fail"
    RECOMPUTE = "recompute"


# ---------------------------------------------------------------- references

RELATIVE_PATH = r"^[^/].*$"
ENGINE_ID = r"^[A-Za-z0-9][-_.A-Za-z0-9]*$"


class SecretKeyRef(ApiModel):
    """A key inside a Secret in the PDService's namespace."""

    name: Annotated[
        str, Field(description="Name of the Secret.", min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    ]
    key: Annotated[
        str,
        Field(
            description="Key inside the Secret whose value is used.",
            min_length=1,
            max_length=253,
            pattern=SECRET_KEY,
        ),
    ]


# ---------------------------------------------------------------- model


class HuggingFaceSource(ApiModel):
    """Download the model from the Hugging Face Hub at start-up."""

    token_secret_ref: Annotated[
        SecretKeyRef | None,
        Field(description="Secret key holding a Hugging Face token (HF_TOKEN), for gated or private models."),
    ] = None


class PVCSource(ApiModel):
    """Load the model from a PersistentVolumeClaim mounted read-only into every engine pod."""

    claim_name: Annotated[
        str,
        Field(
            description="Name of the PersistentVolumeClaim holding the weights.",
            min_length=1,
            max_length=253,
            pattern=DNS_SUBDOMAIN,
        ),
    ]
    path: Annotated[
        str,
        Field(
            description="Directory of the model inside the volume, relative to its root.",
            min_length=1,
            max_length=1024,
            pattern=RELATIVE_PATH,
        ),
    ]


class ModelSource(ApiModel):
    """Where the weights come from: exactly one of huggingFace or pvc."""

    hugging_face: Annotated[
        HuggingFaceSource | None, Field(description="Download from the Hugging Face Hub.")
    ] = None
    pvc: Annotated[PVCSource | None, Field(description="Load from a PersistentVolumeClaim.")] = None


def _hugging_face_source() -> ModelSource:
    return ModelSource(hugging_face=HuggingFaceSource())


class ModelSpec(ApiModel):
    """The model both roles serve."""

    name: Annotated[
        str,
        Field(
            description="Hugging Face model id (org/name) or, with source.pvc, a display name.",
            min_length=1,
            max_length=256,
        ),
    ]
    served_name: Annotated[
        str | None,
        Field(
            description="Model name clients send in requests (defaults to name).",
            min_length=1,
            max_length=256,
        ),
    ] = None
    dtype: Annotated[DType, Field(description="Weight and activation dtype passed to vLLM --dtype.")] = (
        DType.AUTO
    )
    max_model_len: Annotated[
        int | None,
        Field(
            description="Maximum context length in tokens (vLLM --max-model-len); unset uses the model's "
            "own.",
            ge=16,
            le=10_485_760,
        ),
    ] = None
    architecture: Annotated[
        Architecture,
        Field(
            description=(
                "KV-cache shape of the model. dense: attention KV sharded by heads across TP ranks. "
                "hybrid-ssm: attention plus Mamba/GDN state layers (requires spec.ssm). "
                "mla: multi-head latent attention (DeepSeek-style), whose latent KV is the same on every TP "
                "rank."
            )
        ),
    ] = Architecture.DENSE
    source: Annotated[
        ModelSource,
        Field(description="Where the weights come from; defaults to downloading from the Hugging Face Hub."),
    ] = Field(default_factory=_hugging_face_source)


class SSMSpec(ApiModel):
    """State-space layers of a hybrid model and how their state crosses the wire."""

    family: Annotated[
        SsmFamily,
        Field(
            description=(
                "Kind of state layer: mamba2 (x,B,C conv + SSM state), mamba1 (one conv + SSM state; the "
                "builtin connector "
                "serves it in the mock engine only) or gdn (gated delta net, Q/K/V conv)."
            )
        ),
    ]
    conv_state_layout: Annotated[
        ConvLayout,
        Field(
            description=(
                "Memory layout of the convolution state (VLLM_SSM_CONV_STATE_LAYOUT). DS keeps each TP "
                "shard of x, B and C "
                "contiguous so it moves as three descriptors; required when prefill and decode TP differ."
            )
        ),
    ] = ConvLayout.DS


class TransportSpec(ApiModel):
    """How KV blocks move between prefill and decode."""

    backend: Annotated[
        TransportBackend,
        Field(
            description=(
                "NIXL backend: LIBFABRIC (EFA RDMA; required with network.efa), UCX (TCP/RDMA NICs), or mock "
                "(bytes over TCP, for clusters without GPUs; requires engine.runtime mock)."
            )
        ),
    ] = TransportBackend.UCX
    staging_mib: Annotated[
        int,
        Field(
            description=(
                "GPU memory per engine rank (MiB, beside the KV cache; the engine logs its worth in KV "
                "blocks) for push's staged path: scattered blocks gathered, moved in one WRITE, scattered on "
                "decode, when the cost model finds it cheaper than a descriptor per run. Two slots; larger "
                "requests, pull and CPU engines go direct; 0: off."
            ),
            ge=0,
            le=65536,
        ),
    ] = 1024


class EngineSpec(ApiModel):
    """The inference engine both roles run."""

    runtime: Annotated[
        Runtime,
        Field(
            description="vllm: the vLLM OpenAI server. mock: the pd-mock-engine stand-in for GPU-free "
            "clusters."
        ),
    ] = Runtime.VLLM
    image: Annotated[
        str | None,
        Field(
            description=(
                "Engine container image; unset uses the operator's configured default: the pd-engine image "
                "(vLLM + NIXL + pdconnector) for runtime vllm, the operator image for runtime mock."
            ),
            min_length=1,
            max_length=512,
        ),
    ] = None
    connector: Annotated[
        ConnectorImpl,
        Field(
            description="builtin: pd-operator's KV connector. vllm: upstream vLLM's NixlConnector (pull) or "
            "NixlPushConnector (push)."
        ),
    ] = ConnectorImpl.BUILTIN
    transport: Annotated[TransportSpec, Field(description="KV transfer transport.")] = Field(
        default_factory=TransportSpec
    )
    port: Annotated[
        int, Field(description="HTTP port of each engine's OpenAI server (vLLM --port).", ge=1024, le=65535)
    ] = DEFAULT_ENGINE_PORT
    side_channel_port: Annotated[
        int,
        Field(
            description="Port of the connector's side channel (handshake and metadata exchange, "
            "VLLM_NIXL_SIDE_CHANNEL_PORT); must differ from port.",
            ge=1024,
            le=65535,
        ),
    ] = DEFAULT_SIDE_CHANNEL_PORT
    prefill_engine_id: Annotated[
        str | None,
        Field(
            description=(
                "Fixed engine id of the prefill engines. Required for push mode with the upstream "
                "connector, which cannot "
                "learn per-pod ids; the builtin connector derives ids from pod names."
            ),
            min_length=1,
            max_length=128,
            pattern=ENGINE_ID,
        ),
    ] = None
    kv_load_failure_policy: Annotated[
        KVLoadFailurePolicy,
        Field(
            description="What decode does when KV cannot be received: fail the request, or recompute the "
            "prompt locally. A prefill with a KV tier (spec.kvCache.offload.prefill) always recomputes what "
            "its tier could not load."
        ),
    ] = KVLoadFailurePolicy.FAIL
    transfer_timeout_seconds: Annotated[
        int,
        Field(
            description="Deadline for one KV transfer, after which both sides free the blocks and the "
            "request fails.",
            ge=1,
            le=3600,
        ),
    ] = 60
    termination_grace_period_seconds: Annotated[
        int,
        Field(
            description="How long an engine pod that Kubernetes stops (rolling update, node drain, deletion) "
            "has to finish the requests in flight: vLLM drains them (--shutdown-timeout: this less "
            f"{ENGINE_TEARDOWN_SECONDS} s for its teardown), refusing new ones, which the router retries on "
            "other engines; Kubernetes kills the pod after this long.",
            ge=ENGINE_TEARDOWN_SECONDS + 5,
            le=3600,
        ),
    ] = 120


class EFASpec(ApiModel):
    """AWS Elastic Fabric Adapter (RDMA) for KV transfer."""

    enabled: Annotated[bool, Field(description="Request EFA devices and configure libfabric for RDMA.")] = (
        False
    )
    prefill_devices: Annotated[
        int, Field(description="vpc.amazonaws.com/efa devices per prefill pod.", ge=0, le=64)
    ] = 0
    decode_devices: Annotated[
        int, Field(description="vpc.amazonaws.com/efa devices per decode pod.", ge=0, le=64)
    ] = 0
    hugepages: Annotated[
        str, Field(description="hugepages-2Mi per engine pod (libfabric buffers).", pattern=QUANTITY)
    ] = "5Gi"
    privileged: Annotated[
        bool,
        Field(
            description="Run engine containers privileged (some GPU-memory registrations need it); "
            "otherwise only IPC_LOCK is added."
        ),
    ] = False


class NetworkSpec(ApiModel):
    """Networking of the engine pods."""

    efa: Annotated[EFASpec, Field(description="AWS EFA settings.")] = Field(default_factory=EFASpec)


class RouterSpec(ApiModel):
    """The OpenAI-compatible router in front of both roles."""

    replicas: Annotated[int, Field(description="Router pods.", ge=0, le=64)] = 1
    port: Annotated[int, Field(description="Port the router Service listens on.", ge=1, le=65535)] = (
        DEFAULT_ROUTER_PORT
    )
    policy: Annotated[RoutingPolicy, Field(description="Backend selection within each role.")] = (
        RoutingPolicy.LEAST_LOADED
    )
    cache_aware: Annotated[
        CacheAwareSpec | None,
        Field(description="Block size and weights of the cache-aware policy (defaults apply when unset)."),
    ] = None
    retries: Annotated[
        RetriesSpec | None,
        Field(description="Retries of failed requests before their first token (defaults apply when unset)."),
    ] = None
    api_key_secret_ref: Annotated[
        SecretKeyRef | None,
        Field(description="Secret key holding the Bearer API key clients must send; unset disables auth."),
    ] = None
    image: Annotated[
        str | None,
        Field(
            description="Router image; defaults to the operator's configured router image.",
            min_length=1,
            max_length=512,
        ),
    ] = None


_LABEL_VALUE = Annotated[str, Field(description="Label value required under this key.")]


class ScrapePeer(ApiModel):
    """Pods admitted to the engines' HTTP port, where vLLM serves /metrics (a NetworkPolicy peer)."""

    namespace_labels: Annotated[
        dict[str, _LABEL_VALUE] | None,
        Field(
            description="Labels of the namespaces the scrapers run in; {} selects every namespace. Unset: "
            "this PDService's namespace."
        ),
    ] = None
    pod_labels: Annotated[
        dict[str, _LABEL_VALUE] | None,
        Field(
            description="Labels of the scraper pods; {} selects every pod. Unset: every pod of the selected "
            "namespaces."
        ),
    ] = None


class MonitoringSpec(ApiModel):
    """How Prometheus reaches the /metrics of the engines (vLLM's series and the KV connector's) and of the
    router."""

    pod_annotations: Annotated[
        bool,
        Field(
            description=(
                "Annotate engine and router pods with prometheus.io/scrape, port and path, for scrape "
                "configurations that discover pods "
                "by annotation. Off by default: turning it on rolls the engine pods."
            )
        ),
    ] = False
    scrapers: Annotated[
        list[ScrapePeer],
        Field(
            description=(
                "Pods admitted to the engines' HTTP port through this PDService's NetworkPolicy, which "
                "otherwise admits only its own "
                "engines and router. The router's port is open to every pod already."
            ),
            max_length=16,
        ),
    ] = Field(default_factory=list)


class PDServiceSpec(ApiModel):
    """Desired state of a prefill/decode disaggregated vLLM service."""

    mode: Annotated[
        TransferMode,
        Field(
            description="push: decode registers its blocks and prefill writes them as soon as both are "
            "ready. pull: decode reads after prefill."
        ),
    ] = TransferMode.PUSH
    model: Annotated[ModelSpec, Field(description="The served model.")]
    ssm: Annotated[
        SSMSpec | None,
        Field(
            description=(
                "State-space (Mamba/GDN) layers of a hybrid model: their family and the conv-state layout "
                "used for KV transfer. "
                "Required when model.architecture is hybrid-ssm, forbidden otherwise."
            )
        ),
    ] = None
    prefill: Annotated[RoleSpec, Field(description="Prefill engines.")] = Field(default_factory=RoleSpec)
    decode: Annotated[RoleSpec, Field(description="Decode engines.")] = Field(default_factory=RoleSpec)
    engine: Annotated[EngineSpec, Field(description="Engine image, KV connector and transport.")] = Field(
        default_factory=EngineSpec
    )
    network: Annotated[NetworkSpec, Field(description="Pod networking (EFA).")] = Field(
        default_factory=NetworkSpec
    )
    router: Annotated[RouterSpec, Field(description="The router in front of both roles.")] = Field(
        default_factory=RouterSpec
    )
    monitoring: Annotated[MonitoringSpec, Field(description="Metrics scraping of engines and router.")] = (
        Field(default_factory=MonitoringSpec)
    )
    kv_cache: Annotated[KVCacheSpec, Field(description="KV cache tiers beyond GPU memory.")] = Field(
        default_factory=KVCacheSpec
    )
    autoscaling: Annotated[
        AutoscalingSpec | None,
        Field(
            description="Replica counts of both roles sized from latency and queue targets; unset: the roles "
            "run spec.prefill.replicas and spec.decode.replicas."
        ),
    ] = None


class PDService(BaseModel):
    """A parsed PDService object: the metadata the operator needs plus the typed spec."""

    model_config = ConfigDict(frozen=True)

    name: str
    namespace: str
    spec: PDServiceSpec
    generation: int = 1
    uid: str = ""
    # Engines of each role the router sends new requests to, by role ("prefill", "decode"); the role's
    # higher ordinals drain. Not the user's: the autoscaler's observed state. Absent: every replica serves.
    serving: dict[str, int] = {}

    def serving_replicas(self, role: str, replicas: int) -> int:
        return min(self.serving.get(role, replicas), replicas)
