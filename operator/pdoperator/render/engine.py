"""The engine pod: one builder for prefill and decode, which differ only through the spec."""

from __future__ import annotations

import copy
import json
import re
from enum import StrEnum
from typing import Any

from pdconnector.protocol.liveness import LivenessProbe, fence_seconds

from pdoperator.api.model import (
    ENGINE_TEARDOWN_SECONDS,
    Architecture,
    ConnectorImpl,
    KVLoadFailurePolicy,
    PDService,
    PDServiceSpec,
    Runtime,
    TransferMode,
    TransportBackend,
)
from pdoperator.api.roles import RoleSpec

from .cache_routing import kv_events_args, kv_events_container_ports
from .defaults import RenderDefaults
from .identity import compatibility_hash, engine_id, engine_image, role_spec
from .kv_tier import pod_memory, tier_bytes_per_rank
from .monitoring import scrape_annotations
from .names import LABEL_COMPAT, ComponentRole, object_labels, selector_labels


class EnginePod(StrEnum):
    """What one pod runs of its engine: all of it, or one node's ranks of an engine that spans nodes (the
    leader also runs vLLM's API server and engine core; workers join it headless)."""

    WHOLE = "whole"
    LEADER = "leader"
    WORKER = "worker"


BUILTIN_CONNECTOR_CLASS = "PDConnector"
BUILTIN_CONNECTOR_MODULE = "pdconnector.vllm.connector"
UPSTREAM_CONNECTOR_CLASS = {TransferMode.PULL: "NixlConnector", TransferMode.PUSH: "NixlPushConnector"}
KV_ROLE = {ComponentRole.PREFILL: "kv_producer", ComponentRole.DECODE: "kv_consumer"}

CONTAINER_NAME = "engine"
# The container's own filesystem, not a volume: a restarted container must not find its previous life's stale
# heartbeat.
HEARTBEAT_DIR = "/tmp/pdconnector-heartbeat"
TRANSFER_LIVENESS = LivenessProbe()
POD_NAME_REF = "$(POD_NAME)"
# An engine spanning nodes is named after its leader pod on every pod of its group (vLLM builds each node's
# config from its own command line, so all must carry the same engine id).
ENGINE_NAME_REF = "$(ENGINE_NAME)"
LEADER_NAME_ANNOTATION = "leaderworkerset.sigs.k8s.io/leader-name"
# vLLM's torch.distributed rendezvous on the leader (its default port, rendered so the policy can name it).
MASTER_PORT = 29501
MODELS_DIR = "/models"
GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
HUGEPAGES_RESOURCE = "hugepages-2Mi"


def engine_gpus(spec: PDServiceSpec, role: ComponentRole) -> int:
    """GPUs per pod: the explicit count, else one per rank the pod runs."""
    rs = role_spec(spec, role)
    return rs.resources.gpus if rs.resources.gpus is not None else rs.world_size // rs.nodes


def efa_devices(spec: PDServiceSpec, role: ComponentRole) -> int:
    efa = spec.network.efa
    if not efa.enabled:
        return 0
    return efa.prefill_devices if role is ComponentRole.PREFILL else efa.decode_devices


def served_model_name(spec: PDServiceSpec) -> str:
    return spec.model.served_name or spec.model.name


def prefix_caching_enabled(spec: PDServiceSpec, role: ComponentRole) -> bool | None:
    """True/False to force prefix caching on/off, None to keep vLLM's default (on).

    Unset on either role of a hybrid model means off (validation rejects true there). On decode
    a cache hit would skip the transfer of the SSM state the request needs; on GPUs, prefix
    caching also switches vLLM's Mamba cache to 'align' mode, whose state block placement the
    KV connector does not model, so neither role may run with vLLM's default.
    """
    explicit = role_spec(spec, role).enable_prefix_caching
    if explicit is not None:
        return explicit
    if spec.model.architecture is Architecture.HYBRID_SSM:
        return False
    return None


def kv_transfer_config(spec: PDServiceSpec, role: ComponentRole, pod_engine_id: str) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of a vLLM engine, selecting our connector or upstream's."""
    engine = spec.engine
    backends = [engine.transport.backend.value]
    common = {
        "kv_role": KV_ROLE[role],
        "kv_buffer_device": "cuda" if engine_gpus(spec, role) > 0 else "cpu",
        "engine_id": pod_engine_id,
        "kv_load_failure_policy": kv_load_failure_policy(spec, role).value,
    }
    if engine.connector is ConnectorImpl.VLLM:
        return {
            "kv_connector": UPSTREAM_CONNECTOR_CLASS[spec.mode],
            **common,
            "kv_connector_extra_config": {"backends": backends},
        }
    return {
        "kv_connector": BUILTIN_CONNECTOR_CLASS,
        "kv_connector_module_path": BUILTIN_CONNECTOR_MODULE,
        **common,
        "kv_connector_extra_config": {
            "mode": spec.mode.value,
            "backends": backends,
            "side_channel_port": engine.side_channel_port,
            "transfer_timeout_s": engine.transfer_timeout_seconds,
            # Decode's fence outlasts the liveness probe below killing a frozen prefill
            # (pdconnector.protocol.liveness).
            "fence_s": fence_seconds(engine.transfer_timeout_seconds, TRANSFER_LIVENESS),
            "heartbeat_dir": HEARTBEAT_DIR,
            "kv_cache_layout": kv_cache_layout(spec),
            # Only pushes stage, and the staged path's cost model is fitted to GPUs: host memory moves
            # scattered runs well enough.
            "staging_mib": staging_mib(spec, role),
            # the KV tier's host memory per rank; absent without one, so such engines render as before
            **({"tier_bytes": tier} if (tier := tier_bytes_per_rank(spec, role)) else {}),
        },
    }


def kv_load_failure_policy(spec: PDServiceSpec, role: ComponentRole) -> KVLoadFailurePolicy:
    """What vLLM does with blocks a load could not fill: the spec's policy, which is decode's (KV from
    prefill). Prefill loads only from its own KV tier, where recomputing the blocks is always safe: a failed
    tier load never fails a request there."""
    if role is ComponentRole.PREFILL and tier_bytes_per_rank(spec, role):
        return KVLoadFailurePolicy.RECOMPUTE
    return spec.engine.kv_load_failure_policy


def staging_mib(spec: PDServiceSpec, role: ComponentRole) -> int:
    """The staging buffer a role's ranks allocate: push mode on GPUs only."""
    if spec.mode is not TransferMode.PUSH or engine_gpus(spec, role) == 0:
        return 0
    return spec.engine.transport.staging_mib


def kv_cache_layout(spec: PDServiceSpec) -> str:
    """The KV cache layout both roles ask vLLM for (``pdconnector.vllm.config``): block-outermost, so a
    request's scattered blocks cost one descriptor each instead of one per layer each. Between dense engines
    of different TP, BHLNC keeps the head slice one engine's rank takes of every layer in one run; hybrid
    models' mixed attention and SSM pages fit only BLHNC, which is also what equal TP needs."""
    if (
        spec.model.architecture is Architecture.DENSE
        and spec.prefill.tensor_parallel_size != spec.decode.tensor_parallel_size
    ):
        return "BHLNC"
    return "BLHNC"


def _vllm_args(spec: PDServiceSpec, role: ComponentRole, rs: RoleSpec, pod_engine_id: str) -> list[str]:
    model = spec.model
    pvc = model.source.pvc
    args = [
        "--model",
        f"{MODELS_DIR}/{pvc.path}" if pvc else model.name,
        "--served-model-name",
        served_model_name(spec),
        "--port",
        str(spec.engine.port),
        "--tensor-parallel-size",
        str(rs.tensor_parallel_size),
        "--dtype",
        model.dtype.value,
    ]
    if rs.pipeline_parallel_size > 1:
        args += ["--pipeline-parallel-size", str(rs.pipeline_parallel_size)]
    if rs.enable_expert_parallel:
        args.append("--enable-expert-parallel")
    if model.max_model_len is not None:
        args += ["--max-model-len", str(model.max_model_len)]
    if rs.max_num_seqs is not None:
        args += ["--max-num-seqs", str(rs.max_num_seqs)]
    prefix_caching = prefix_caching_enabled(spec, role)
    if prefix_caching is not None:
        args.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    args += kv_events_args(spec)
    # SIGTERM drains the requests in flight instead of aborting them (vLLM's default, 0).
    args += [
        "--shutdown-timeout",
        str(spec.engine.termination_grace_period_seconds - ENGINE_TEARDOWN_SECONDS),
    ]
    args += [
        "--kv-transfer-config",
        json.dumps(kv_transfer_config(spec, role, pod_engine_id), separators=(",", ":")),
    ]
    return args


def _mock_args(
    spec: PDServiceSpec, role: ComponentRole, rs: RoleSpec, pod_engine_id: str, compat_hash: str
) -> list[str]:
    # The mock engine's transports: bytes over TCP, or NIXL (its UCX backend) over host or GPU memory.
    transport = "mock" if spec.engine.transport.backend is TransportBackend.MOCK else "nixl"
    # A pod with GPUs keeps its KV in them when NIXL moves it; the TCP mock transport can only move host
    # memory.
    kv_device = ["--kv-device", "cuda"] if transport == "nixl" and engine_gpus(spec, role) > 0 else []
    return [
        "--role",
        role.value,
        "--port",
        str(spec.engine.port),
        "--model",
        served_model_name(spec),
        "--engine-id",
        pod_engine_id,
        "--side-channel-host",
        "$(POD_IP)",
        "--side-channel-port",
        str(spec.engine.side_channel_port),
        "--tp-size",
        str(rs.tensor_parallel_size),
        "--transport",
        transport,
        # Advertised on /health, so the router pairs only engines of the current generation.
        "--compat-hash",
        compat_hash,
        "--transfer-timeout",
        str(spec.engine.transfer_timeout_seconds),
        *kv_device,
        *_mock_context_args(spec.model.max_model_len),
    ]


# The mock engine's pool: 4096 blocks of 16 tokens unless a request may span more.
MOCK_POOL_BLOCKS = 4096
MOCK_BLOCK_SIZE = 16


def _mock_context_args(max_model_len: int | None) -> list[str]:
    """The mock engine refuses requests past ``--max-model-len``, like vLLM; its pool must hold one such
    request."""
    if max_model_len is None:
        return []
    blocks = -(-max_model_len // MOCK_BLOCK_SIZE)
    return [
        "--max-model-len",
        str(max_model_len),
        *(["--num-blocks", str(blocks)] if blocks > MOCK_POOL_BLOCKS else []),
    ]


def _node_args(rs: RoleSpec, pod: EnginePod) -> list[str]:
    """How a pod of an engine spanning nodes joins it: vLLM's multi-node launch, the leader as node 0 (LWS
    injects the leader's address and each worker's index)."""
    if pod is EnginePod.WHOLE:
        return []
    rank = "0" if pod is EnginePod.LEADER else "$(LWS_WORKER_INDEX)"
    args = ["--nnodes", str(rs.nodes), "--node-rank", rank, "--master-addr", "$(LWS_LEADER_ADDRESS)"]
    args += ["--master-port", str(MASTER_PORT)]
    return args + (["--headless"] if pod is EnginePod.WORKER else [])


def engine_command(
    pds: PDService, role: ComponentRole, defaults: RenderDefaults, pod: EnginePod = EnginePod.WHOLE
) -> tuple[list[str], list[str]]:
    """(command, args) of the engine container; ``$(POD_NAME)`` is expanded by the kubelet."""
    spec = pds.spec
    rs = role_spec(spec, role)
    compat_hash = compatibility_hash(spec, defaults)
    name = POD_NAME_REF if pod is EnginePod.WHOLE else ENGINE_NAME_REF
    pod_engine_id = engine_id(spec, role, name, compat_hash)
    if spec.engine.runtime is Runtime.MOCK:
        return ["pd-mock-engine"], [*_mock_args(spec, role, rs, pod_engine_id, compat_hash), *rs.extra_args]
    vllm_args = [*_vllm_args(spec, role, rs, pod_engine_id), *_node_args(rs, pod), *rs.extra_args]
    if pod is EnginePod.WHOLE:
        return ["python3", "-m", "vllm.entrypoints.openai.api_server"], vllm_args
    # vllm serve: its --headless mode, which the workers need, is not the API server module's
    return ["vllm", "serve"], vllm_args


CPU_THREAD_BINDING_ENV = "VLLM_CPU_OMP_THREADS_BIND"
CUDA_IPC_GET_ENV = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"


def _field_env(name: str, field_path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def _node_env(pod: EnginePod) -> list[dict[str, Any]]:
    """A pod of an engine spanning nodes: the engine's name, and the address torch.distributed and NIXL
    advertise for this node's ranks (vLLM would guess one otherwise)."""
    if pod is EnginePod.WHOLE:
        return []
    name = "metadata.name" if pod is EnginePod.LEADER else f"metadata.annotations['{LEADER_NAME_ANNOTATION}']"
    return [_field_env("ENGINE_NAME", name), {"name": "VLLM_HOST_IP", "value": "$(POD_IP)"}]


def _engine_env(
    spec: PDServiceSpec, role: ComponentRole, defaults: RenderDefaults, pod: EnginePod
) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        # The downward-API variables come first: later values refer to them as $(VAR).
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env("POD_IP", "status.podIP"),
        _field_env("POD_UID", "metadata.uid"),
        *_node_env(pod),
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "$(POD_IP)"},
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(spec.engine.side_channel_port)},
    ]
    if spec.model.architecture is Architecture.HYBRID_SSM and spec.ssm is not None:
        env.append({"name": "VLLM_SSM_CONV_STATE_LAYOUT", "value": spec.ssm.conv_state_layout.value})
    if spec.engine.runtime is Runtime.VLLM:
        hf = spec.model.source.hugging_face
        if spec.model.source.pvc is None:
            env.append({"name": "HF_HOME", "value": defaults.huggingface_cache_dir})
        if hf is not None and hf.token_secret_ref is not None:
            ref = hf.token_secret_ref
            env.append(
                {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
            )
        user_names = {var.name for var in role_spec(spec, role).env}
        if engine_gpus(spec, role) == 0 and CPU_THREAD_BINDING_ENV not in user_names:
            # vLLM's CPU backend binds each engine's threads from core 0 regardless of its share of the node,
            # so engines on one node and their transfer threads pile onto the same cores; the scheduler
            # spreads them better.
            env.append({"name": CPU_THREAD_BINDING_ENV, "value": "nobind"})
        if (
            engine_gpus(spec, role) > 0
            and spec.engine.transport.backend is TransportBackend.UCX
            and CUDA_IPC_GET_ENV not in user_names
        ):
            # UCX turns CUDA-IPC READs off where it sees no NVLink, and pull-mode READs between GPUs of one
            # node then go over TCP: a 128 MiB READ took 283 ms instead of 0.66 ms on an H200
            # (docs/benchmarks.md). WRITEs are unaffected.
            env.append({"name": CUDA_IPC_GET_ENV, "value": "y"})
    if spec.network.efa.enabled:
        env += [
            {"name": "FI_PROVIDER", "value": "efa"},
            {"name": "FI_EFA_USE_DEVICE_RDMA", "value": "1"},
            {"name": "LD_LIBRARY_PATH", "value": defaults.efa_library_path},
        ]
    # Validation rejects user variables that collide with these names.
    return env + [{"name": var.name, "value": var.value} for var in role_spec(spec, role).env]


def _is_zero_quantity(quantity: str) -> bool:
    return re.fullmatch(r"[+-]?0*\.?0*([eE][-+]?[0-9]+|[a-zA-Z]*)", quantity) is not None


def _engine_resources(spec: PDServiceSpec, role: ComponentRole) -> dict[str, Any]:
    rs = role_spec(spec, role)
    amounts: dict[str, Any] = {}
    if rs.resources.cpu is not None:
        amounts["cpu"] = rs.resources.cpu
    if rs.resources.memory is not None:
        amounts["memory"] = pod_memory(spec, role, rs.resources.memory)
    if (gpus := engine_gpus(spec, role)) > 0:
        amounts[GPU_RESOURCE] = gpus
    if (devices := efa_devices(spec, role)) > 0:
        amounts[EFA_RESOURCE] = devices
    if spec.network.efa.enabled and not _is_zero_quantity(spec.network.efa.hugepages):
        amounts[HUGEPAGES_RESOURCE] = spec.network.efa.hugepages
    # Extended resources and hugepages must have requests == limits; cpu and memory
    # follow so the engines get the Guaranteed QoS class and are evicted last.
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def _engine_security_context(spec: PDServiceSpec) -> dict[str, Any] | None:
    efa = spec.network.efa
    if efa.enabled and efa.privileged:
        return {"privileged": True}
    if efa.enabled:
        # libfabric pins (locks) its registered buffers.
        return {"capabilities": {"add": ["IPC_LOCK"]}}
    return None


def _volumes_and_mounts(
    spec: PDServiceSpec, role: ComponentRole, defaults: RenderDefaults
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rs = role_spec(spec, role)
    # NCCL and NIXL exchange buffers through /dev/shm; the container default is 64Mi.
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": rs.resources.shm_size}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if spec.engine.runtime is Runtime.VLLM:
        pvc = spec.model.source.pvc
        if pvc is not None:
            volumes.append(
                {"name": "models", "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": True}}
            )
            mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
        else:
            volumes.append({"name": "model-cache", "emptyDir": {}})
            mounts.append({"name": "model-cache", "mountPath": defaults.huggingface_cache_dir})
    return volumes, mounts


def _health_probe(period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _transfer_liveness_probe(spec: PDServiceSpec, pod: EnginePod) -> dict[str, Any]:
    """Our connector's liveness: the transfer threads' heartbeat (a frozen or stuck engine dies within the
    bound its peers' fence counts on) and, where the pod serves it, the engine's own /health."""
    probe = TRANSFER_LIVENESS
    command = [
        "python3",
        "-m",
        "pdconnector.worker.liveness",
        HEARTBEAT_DIR,
        "--max-age",
        str(probe.heartbeat_max_age_s),
    ]
    if pod is not EnginePod.WORKER:
        command += ["--url", f"http://127.0.0.1:{spec.engine.port}/health"]
        command += ["--timeout", str(probe.timeout_s - 1)]
    return {
        "exec": {"command": command},
        "periodSeconds": probe.period_s,
        "timeoutSeconds": probe.timeout_s,
        "failureThreshold": probe.failure_threshold,
        "terminationGracePeriodSeconds": probe.termination_grace_s,
    }


def _engine_probes(spec: PDServiceSpec, defaults: RenderDefaults, pod: EnginePod) -> dict[str, Any]:
    startup_period = 10
    builtin = spec.engine.connector is not ConnectorImpl.VLLM
    if pod is EnginePod.WORKER:
        # No HTTP server: ready once running (its group is ready with the leader); a rank that exits ends
        # the container, and the group restarts as one.
        return {"livenessProbe": _transfer_liveness_probe(spec, pod)} if builtin else {}
    return {
        "startupProbe": _health_probe(
            startup_period, max(1, defaults.engine_startup_budget_seconds // startup_period)
        ),
        "readinessProbe": _health_probe(5, 3),
        "livenessProbe": _transfer_liveness_probe(spec, pod) if builtin else _health_probe(10, 6),
    }


def _engine_affinity(pds: PDService, role: ComponentRole) -> dict[str, Any] | None:
    """The user's affinity, plus prefill/decode on different hosts when EFA carries the KV."""
    affinity = copy.deepcopy(role_spec(pds.spec, role).affinity) or {}
    if pds.spec.network.efa.enabled:
        peer = ComponentRole.DECODE if role is ComponentRole.PREFILL else ComponentRole.PREFILL
        term = {
            "labelSelector": {"matchLabels": selector_labels(pds, peer)},
            "topologyKey": "kubernetes.io/hostname",
        }
        anti = affinity.setdefault("podAntiAffinity", {})
        anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(term)
    return affinity or None


def _engine_ports(spec: PDServiceSpec, pod: EnginePod) -> list[dict[str, Any]]:
    """What the pod serves: a worker of an engine spanning nodes only its ranks' NIXL and torch.distributed
    traffic, on ports they pick at run time."""
    if pod is EnginePod.WORKER:
        return []
    return [
        {"name": "http", "containerPort": spec.engine.port, "protocol": "TCP"},
        {"name": "side-channel", "containerPort": spec.engine.side_channel_port, "protocol": "TCP"},
        *kv_events_container_ports(spec),
    ]


def render_engine_pod_template(
    pds: PDService, role: ComponentRole, defaults: RenderDefaults, pod: EnginePod = EnginePod.WHOLE
) -> dict[str, Any]:
    """The pod template of one engine role's StatefulSet, or of the leaders or workers of its
    LeaderWorkerSet."""
    spec = pds.spec
    rs = role_spec(spec, role)
    command, args = engine_command(pds, role, defaults, pod)
    volumes, mounts = _volumes_and_mounts(spec, role, defaults)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": engine_image(spec, role, defaults),
        "command": command,
        "args": args,
        "env": _engine_env(spec, role, defaults, pod),
        "ports": _engine_ports(spec, pod),
        "resources": _engine_resources(spec, role),
        **_engine_probes(spec, defaults, pod),
        "volumeMounts": mounts,
    }
    if not container["ports"]:
        del container["ports"]
    if (security_context := _engine_security_context(spec)) is not None:
        container["securityContext"] = security_context
    pod_spec: dict[str, Any] = {
        # Service links would inject <SERVICE>_PORT variables; a Service named "vllm"
        # yields VLLM_PORT, which vLLM reads as its own setting.
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.engine.termination_grace_period_seconds,
        "containers": [container],
        "volumes": volumes,
    }
    if rs.node_selector:
        pod_spec["nodeSelector"] = dict(rs.node_selector)
    if rs.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in rs.tolerations
        ]
    if (affinity := _engine_affinity(pds, role)) is not None:
        pod_spec["affinity"] = affinity
    return {
        "metadata": {
            "labels": {**object_labels(pds, role), LABEL_COMPAT: compatibility_hash(spec, defaults)},
            "annotations": {
                "kubectl.kubernetes.io/default-container": CONTAINER_NAME,
                # a worker serves no metrics: its engine's leader reports for all of its ranks
                **(scrape_annotations(pds, spec.engine.port) if pod is not EnginePod.WORKER else {}),
            },
        },
        "spec": pod_spec,
    }
