"""The router's whole view of one PDService: what the operator writes into ``<name>-router``.

The operator renders this model into the ``router.yaml`` key of the router's ConfigMap;
``pdctl up`` writes the same file for local runs. The router loads it at start-up and
again whenever the file changes (ConfigMap updates arrive without a pod restart), so the
model is the only contract between the two: no Kubernetes API access is needed.

Engine identity: every engine pod runs with engine id ``<pod name>-<compat hash>`` (a
fixed ``spec.engine.prefillEngineId`` replaces the prefill ids). The compatibility hash
covers exactly the settings that must agree for a prefill and a decode engine to
exchange KV blocks, so during a rollout a pod whose engine id differs from the one
listed here still runs the old generation and must not be paired with the new one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

ROUTER_CONFIG_FILENAME = "router.yaml"
DEFAULT_API_KEY_ENV = "PD_ROUTER_API_KEY"
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
# The largest spec.model.maxModelLen the operator accepts: with no model length configured, no request may ask
# for more.
MAX_MODEL_LEN_CEILING = 10_485_760

Port = Annotated[int, Field(ge=1, le=65535)]


class _ConfigModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineBackend(_ConfigModel):
    """One engine pod of a role."""

    name: Annotated[str, Field(min_length=1, description="Pod name, e.g. tiny-prefill-0.")]
    host: Annotated[
        str, Field(min_length=1, description="Stable DNS name of the pod (resolves while the pod is ready).")
    ]
    engine_id: Annotated[
        str, Field(min_length=1, description="The engine id the pod's KV connector runs with.")
    ]
    draining: Annotated[
        bool,
        Field(
            description="Out of the pool: no new request goes to it, those it holds finish (the operator "
            "removes it once idle)."
        ),
    ] = False
    kv_events_endpoint: Annotated[
        str | None,
        Field(
            min_length=1,
            description="Where this engine publishes its KV cache events, where not tcp://<host>:<the role's "
            "kv_events_port> (local runs: an ipc:// socket per engine).",
        ),
    ] = None


class RoleBackends(_ConfigModel):
    """The engines of one role (prefill or decode) and how to reach them."""

    service: Annotated[
        str,
        Field(min_length=1, description="DNS name of the role's headless Service (A records of ready pods)."),
    ]
    namespace: Annotated[str, Field(min_length=1)]
    http_port: Port = 8000
    side_channel_port: Port = 5600
    tp_size: Annotated[int, Field(ge=1)] = 1
    kv_events_port: Annotated[
        Port | None,
        Field(description="Port the engines publish vLLM's KV cache events on; null: they publish none."),
    ] = None
    replicas: Annotated[int, Field(ge=0)] = 1
    backends: list[EngineBackend] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_backend_per_replica(self) -> RoleBackends:
        if len(self.backends) != self.replicas:
            raise ValueError(f"replicas is {self.replicas} but {len(self.backends)} backends are listed")
        return self


class Timeouts(_ConfigModel):
    """Per-phase deadlines of one request, in seconds; each phase starts when the previous one ends."""

    connect_s: Annotated[float, Field(gt=0, description="TCP connect to a backend.")] = 5.0
    prefill_s: Annotated[float, Field(gt=0, description="Prefill leg, from sending it to its response.")] = (
        120.0
    )
    transfer_s: Annotated[
        float, Field(gt=0, description="KV transfer (spec.engine.transferTimeoutSeconds), after prefill.")
    ] = 60.0
    decode_first_token_s: Annotated[
        float, Field(gt=0, description="Decode's first token, after the KV arrived.")
    ] = 60.0


MAX_ATTEMPTS = 10


class Retries(_ConfigModel):
    """How hard the router tries a request whose leg failed before anything reached its client
    (spec.router.retries)."""

    attempts: Annotated[
        int,
        Field(ge=1, le=MAX_ATTEMPTS, description="Most prefill/decode pairs one request is tried on."),
    ] = 3
    budget_s: Annotated[
        float,
        Field(gt=0, le=3600, description="A failed request is tried again only this long after it arrived."),
    ] = 30.0


class CacheAware(_ConfigModel):
    """How the cache-aware policy hashes prompts (as the engines do) and weighs cache against load."""

    block_size: Annotated[int, Field(ge=1, description="The engines' KV block size in tokens.")]
    hash_algorithm: Literal["sha256", "sha256_cbor"] = "sha256"
    hash_seed: Annotated[
        str | None,
        Field(description="The engines' PYTHONHASHSEED, when set; null: vLLM's default seed."),
    ] = None
    kv_events_topic: str = ""
    kv_events_replay: Annotated[
        bool,
        Field(
            description="The engines keep vLLM's replay socket next to their events endpoint (see "
            "kv_events_replay_endpoint): a router that starts later asks it for what they already hold."
        ),
    ] = False
    prefix_weight: Annotated[float, Field(ge=0)] = 1.0
    tier_weight: Annotated[
        float,
        Field(
            ge=0,
            le=1,
            description="A prompt token in an engine's KV tier (host memory) against one in its GPU cache: "
            "loaded, not computed, so worth nearly as much to prefill.",
        ),
    ] = 0.8
    load_weight: Annotated[float, Field(ge=0)] = 1.0
    max_imbalance: Annotated[int, Field(ge=0)] = 4
    kv_usage_weight: Annotated[float, Field(ge=0)] = 4.0
    index_blocks: Annotated[
        int,
        Field(
            ge=1,
            le=10_000_000,
            description="Most block hashes remembered per engine (the bound on the router's memory; without "
            "events, also the cache size the router assumes).",
        ),
    ] = 65_536


class RouterConfig(_ConfigModel):
    """Everything the router needs to serve one PDService."""

    name: Annotated[str, Field(min_length=1, description="The PDService's name.")]
    namespace: Annotated[str, Field(min_length=1)]
    mode: Literal["push", "pull"]
    served_model_name: Annotated[str, Field(min_length=1)]
    max_model_len: Annotated[
        int | None,
        Field(
            ge=2,
            le=MAX_MODEL_LEN_CEILING,
            description="Context length of the served model (spec.model.maxModelLen); null: unknown, "
            "requests are bounded by the ceiling.",
        ),
    ] = None
    policy: Literal["least-loaded", "round-robin", "cache-aware"] = "least-loaded"
    cache_aware: CacheAware | None = None
    connector: Literal["builtin", "vllm"] = "builtin"
    compat_hash: Annotated[str, Field(min_length=1, description="Suffix of every current engine id.")]
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    listen_port: Port = 8000
    prefill: RoleBackends
    decode: RoleBackends
    timeouts: Timeouts = Field(default_factory=Timeouts)
    retries: Retries = Field(default_factory=Retries)
    max_request_body_bytes: Annotated[int, Field(ge=1024)] = DEFAULT_MAX_REQUEST_BODY_BYTES
    api_key_env: Annotated[
        str | None,
        Field(
            min_length=1,
            description="Environment variable holding the Bearer API key clients must send; null disables "
            "auth.",
        ),
    ] = None

    @model_validator(mode="after")
    def _cache_aware_configured(self) -> RouterConfig:
        if self.policy == "cache-aware" and self.cache_aware is None:
            raise ValueError("policy cache-aware needs cache_aware (the engines' block size and hashing)")
        return self


def kv_events_replay_endpoint(events_endpoint: str) -> str:
    """Where an engine keeps vLLM's replay socket, by the operator's convention: the events port + 1 (tcp),
    or the events socket's path + ``-replay`` (ipc)."""
    if events_endpoint.startswith("ipc://"):
        return f"{events_endpoint}-replay"
    address, _, port = events_endpoint.rpartition(":")
    if not address or not port.isdigit():
        raise ValueError(f"KV events endpoint {events_endpoint!r} is neither tcp://HOST:PORT nor ipc://PATH")
    return f"{address}:{int(port) + 1}"


def dump_router_config(config: RouterConfig) -> str:
    """The YAML text of a config (stable key order, so equal configs give equal text)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


def parse_router_config(text: str) -> RouterConfig:
    """Parse YAML text; raises ``ValueError`` (pydantic's ``ValidationError`` or a YAML error) on bad
    input."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"router config is not valid YAML: {error}") from error
    if not isinstance(data, dict):
        raise ValueError("router config must be a YAML mapping")
    return RouterConfig.model_validate(data)


def load_router_config(path: str | Path) -> RouterConfig:
    """Read and validate the config file the operator (or ``pdctl up``) wrote."""
    return parse_router_config(Path(path).read_text(encoding="utf-8"))
