"""From rendered manifests to local processes: what `pdctl up` runs instead of a cluster.

The plan takes the very manifests the operator would apply and turns each pod into a
process: the container's command and arguments with the downward-API variables expanded
(``$(POD_NAME)``, ``$(POD_IP)``...), the router's ConfigMap with pod DNS names replaced by
the processes' addresses. Each "pod" gets its own loopback address (127.x.y.z) so every
engine keeps the ports the spec gives it, exactly as pods of a StatefulSet share ports
on distinct pod IPs.

Engines run as the spec says: mock engines, or vLLM loading a model directory on this machine, with the
environment a local run needs (offline; on the CPU a small KV space; on GPUs this machine's site and each
engine's GPUs and memory share, ``pdoperator.local.gpu``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sys
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdconnector.router.config import dump_router_config, kv_events_replay_endpoint, parse_router_config

from pdoperator.api import PDService, Runtime
from pdoperator.render import LABEL_ROLE, ComponentRole
from pdoperator.render.engine import CPU_THREAD_BINDING_ENV, engine_gpus
from pdoperator.render.identity import role_spec

from .gpu import LocalSite, SiteError, load_site, place_engines, with_site_args

ROUTER_CONFIG_FILE = "router.yaml"
MOCK_STARTUP_TIMEOUT_S = 90.0
# vLLM's first start on a loaded 2-core machine can take minutes (compilation, NIXL agents).
VLLM_STARTUP_TIMEOUT_S = 420.0
_VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_FIELD_REFS = ("metadata.name", "metadata.namespace", "status.podIP", "metadata.uid")


class LocalRunError(ValueError):
    """The PDService cannot run as local processes; the message says why."""


@dataclass(frozen=True)
class LocalProcess:
    """One pod of the PDService as a local process."""

    name: str
    role: ComponentRole
    argv: tuple[str, ...]
    env: Mapping[str, str]
    host: str
    http_port: int
    startup_timeout_s: float = MOCK_STARTUP_TIMEOUT_S
    kv_events_endpoint: str | None = None  # where it publishes vLLM's KV cache events, if it does

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"


@dataclass(frozen=True)
class LocalPlan:
    """Everything `pdctl up` starts, in start order (engines before the router)."""

    name: str
    namespace: str
    processes: tuple[LocalProcess, ...]
    router_config: str

    @property
    def endpoint(self) -> str:
        return next(process.url for process in self.processes if process.role is ComponentRole.ROUTER)


def loopback_subnet(namespace: str, name: str) -> str:
    """A loopback /24 of this PDService's own (127.a.b.0), so two local runs never share addresses."""
    digest = hashlib.sha256(f"{namespace}/{name}".encode()).digest()
    return f"127.{1 + digest[0] % 254}.{digest[1]}"


def expand(text: str, variables: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined variables are replaced, ``$$`` escapes, anything else
    stays."""
    parts = text.split("$$")
    return "$".join(
        _VARIABLE.sub(lambda match: variables.get(match.group(1), match.group(0)), part) for part in parts
    )


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]["containers"][0]


def _pod_env(container: dict[str, Any], fields: Mapping[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet would compute it: downward-API fields, then values in
    order."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        field_ref = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if field_ref is not None:
            env[item["name"]] = fields[field_ref]
        elif "value" in item:
            env[item["name"]] = expand(item["value"], env)
        else:
            raise LocalRunError(
                f"env {item['name']} of {container['name']} comes from a Secret or ConfigMap, which a local "
                "run cannot read"
            )
    return env


# The images' console scripts as modules, for a source tree on PYTHONPATH that was never installed (no scripts
# to run).
_CONSOLE_SCRIPT_MODULES = {"pd-mock-engine": "pdconnector.sim.main", "pd-router": "pdconnector.router.main"}


def _executable(argv: list[str]) -> list[str]:
    """Console scripts and python3 resolve to this interpreter's environment, wherever pdctl was started
    from."""
    bin_dir = Path(sys.executable).parent
    if argv[0] in {"python3", "python"}:
        return [sys.executable, *argv[1:]]
    script = bin_dir / argv[0]
    if script.exists():
        return [str(script), *argv[1:]]
    if argv[0] in _CONSOLE_SCRIPT_MODULES:
        return [sys.executable, "-m", _CONSOLE_SCRIPT_MODULES[argv[0]], *argv[1:]]
    return argv


@dataclass(frozen=True)
class _VllmSetup:
    model_dir: Path
    env: Mapping[str, str]
    site: LocalSite | None = None  # engines on GPUs: this machine's site


def local_vllm_env(state_dir: Path, *, gpus: bool = False) -> dict[str, str]:
    """What a vLLM engine needs on a developer machine beyond the pod's env: offline, its own caches, and on
    the CPU a small KV space."""
    return {
        **({} if gpus else {"VLLM_CPU_KVCACHE_SPACE": "1"}),
        "HF_HOME": str(state_dir / "hf-home"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _with_model_dir(argv: list[str], model_dir: Path) -> list[str]:
    """The engine's ``--model`` pointed at a directory on this machine (the pod would download or mount
    it)."""
    argv = list(argv)
    argv[argv.index("--model") + 1] = str(model_dir)
    return argv


def _local_kv_events(argv: list[str], state_dir: Path, pod_name: str) -> tuple[list[str], str | None]:
    """The engine's KV events on an ipc socket of its own: vLLM binds only wildcard (or ipc) endpoints, and
    local engines share one network namespace, so the pods' common port would collide."""
    if "--kv-events-config" not in argv:
        return argv, None
    flag = argv.index("--kv-events-config") + 1
    digest = hashlib.sha256(f"{state_dir.resolve()}/{pod_name}".encode()).hexdigest()[:16]
    endpoint = f"ipc://{tempfile.gettempdir()}/pd-{digest}.kv"  # short: ipc paths are limited to ~100 bytes
    argv = list(argv)
    events = {**json.loads(argv[flag]), "endpoint": endpoint}
    if "replay_endpoint" in events:
        events["replay_endpoint"] = kv_events_replay_endpoint(endpoint)
    argv[flag] = json.dumps(events, separators=(",", ":"))
    return argv, endpoint


def _engine_processes(
    statefulset: dict[str, Any], subnet: str, first_host: int, vllm: _VllmSetup | None, state_dir: Path
) -> list[LocalProcess]:
    role = ComponentRole(statefulset["metadata"]["labels"][LABEL_ROLE])
    container = _container(statefulset)
    http_port = next(port["containerPort"] for port in container["ports"] if port["name"] == "http")
    processes = []
    for index in range(statefulset["spec"]["replicas"]):
        pod_name = f"{statefulset['metadata']['name']}-{index}"
        host = f"{subnet}.{first_host + index}"
        fields = dict(
            zip(
                _FIELD_REFS,
                (
                    pod_name,
                    statefulset["metadata"]["namespace"],
                    host,
                    str(uuid.uuid5(uuid.NAMESPACE_DNS, pod_name)),
                ),
                strict=True,
            )
        )
        env = _pod_env(container, fields)
        argv = [expand(arg, env) for arg in [*container["command"], *container.get("args", [])]]
        argv, kv_events = _local_kv_events(argv, state_dir, pod_name)
        timeout = MOCK_STARTUP_TIMEOUT_S
        if vllm is not None:
            argv, env, timeout = (
                _with_model_dir(argv, vllm.model_dir),
                {**env, **vllm.env},
                VLLM_STARTUP_TIMEOUT_S,
            )
        processes.append(
            LocalProcess(
                pod_name, role, (*_executable(argv), "--host", host), env, host, http_port, timeout, kv_events
            )
        )
    return processes


def core_bindings(ranks_per_engine: Sequence[int], cores: Sequence[int]) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` per engine: each rank its own cores, as pods with exclusive CPUs would
    have.

    With fewer cores than ranks, ranks share cores round-robin (one each). Ranks of one engine are
    separated by ``|``, vLLM's syntax for tensor-parallel workers."""
    per_rank = max(1, len(cores) // max(1, sum(ranks_per_engine)))
    bindings = []
    rank = 0
    for ranks in ranks_per_engine:
        parts = []
        for _ in range(ranks):
            start = (rank * per_rank) % len(cores)
            parts.append(",".join(str(core) for core in cores[start : start + per_rank]))
            rank += 1
        bindings.append("|".join(parts))
    return bindings


def _bound_to_own_cores(
    pds: PDService, engines: list[LocalProcess], cores: Sequence[int]
) -> list[LocalProcess]:
    """Engines pinned to cores of their own unless the spec's env says otherwise.

    Unbound CPU engines on one machine each spread their OpenMP threads over every core and spin
    against each other: measured here, two tiny engines decoded at ~100 ms per token instead of ~2 ms."""
    tp = {
        ComponentRole.PREFILL: pds.spec.prefill.tensor_parallel_size,
        ComponentRole.DECODE: pds.spec.decode.tensor_parallel_size,
    }
    bindings = core_bindings([tp[engine.role] for engine in engines], cores)
    user_set = {
        role: any(var.name == CPU_THREAD_BINDING_ENV for var in role_spec(pds.spec, role).env) for role in tp
    }
    return [
        engine
        if user_set[engine.role]
        else dataclasses.replace(engine, env={**engine.env, CPU_THREAD_BINDING_ENV: binding})
        for engine, binding in zip(engines, bindings, strict=True)
    ]


def _gpu_site(pds: PDService, site: LocalSite | None) -> LocalSite | None:
    """This machine's site when the spec's engines take GPUs (all or none: a mixed spec is refused), else
    None."""
    gpus = {role: engine_gpus(pds.spec, role) for role in (ComponentRole.PREFILL, ComponentRole.DECODE)}
    if not any(gpus.values()):
        return None
    try:
        site = site or load_site()
    except SiteError as error:
        raise LocalRunError(str(error)) from error
    for role, count in gpus.items():
        if count == 0:
            raise LocalRunError(
                f"spec.{role.value}: no GPUs while the other role has some; a local run puts both on GPUs or "
                "both on the CPU"
            )
        if count > site.gpus:
            raise LocalRunError(
                f"spec.{role.value}: {count} GPUs per engine and {site.source} has {site.gpus}; a local vLLM "
                "run without enough GPUs uses the CPU (set resources.gpus: 0)"
            )
    return site


def _on_gpus(engines: list[LocalProcess], pds: PDService, site: LocalSite) -> list[LocalProcess]:
    """Each engine on its GPUs (``CUDA_VISIBLE_DEVICES``) with its memory share and the site's flags and
    env."""
    placements = place_engines([engine_gpus(pds.spec, engine.role) for engine in engines], site)
    return [
        dataclasses.replace(
            engine,
            argv=tuple(with_site_args(engine.argv, site, placement)),
            env={**engine.env, **site.engine_env, "CUDA_VISIBLE_DEVICES": placement.visible_devices},
        )
        for engine, placement in zip(engines, placements, strict=True)
    ]


def plan_local_run(
    pds: PDService,
    manifests: list[dict[str, Any]],
    state_dir: Path,
    *,
    model_dir: Path | None = None,
    site: LocalSite | None = None,
) -> LocalPlan:
    """The processes that run ``pds`` on this machine, from the manifests ``render_pdservice`` produced.

    With ``spec.engine.runtime: vllm`` the engines load ``model_dir`` (required) instead of ``spec.model``;
    with
    GPUs in the spec they run on this machine's GPUs as ``site`` (default: ``PDCTL_SITE``'s) says."""
    vllm = None
    if pds.spec.engine.runtime is Runtime.VLLM:
        if model_dir is None:
            raise LocalRunError(
                "spec.engine.runtime is vllm: a local run needs the model on this machine "
                "(pdctl up --engine vllm writes a tiny one, or pass --model-dir DIR)"
            )
        gpu_site = _gpu_site(pds, site)
        vllm = _VllmSetup(model_dir, local_vllm_env(state_dir, gpus=gpu_site is not None), gpu_site)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for manifest in manifests:
        by_kind.setdefault(manifest["kind"], []).append(manifest)
    subnet = loopback_subnet(pds.namespace, pds.name)
    engines: list[LocalProcess] = []
    for offset, statefulset in zip((10, 130), by_kind["StatefulSet"], strict=True):
        engines += _engine_processes(statefulset, subnet, offset, vllm, state_dir)
    if vllm is not None and vllm.site is not None:
        engines = _on_gpus(engines, pds, vllm.site)
    elif vllm is not None:
        engines = _bound_to_own_cores(pds, engines, sorted(os.sched_getaffinity(0)))

    config = parse_router_config(by_kind["ConfigMap"][0]["data"][ROUTER_CONFIG_FILE])
    by_name = {engine.name: engine for engine in engines}
    local_config = config.model_copy(
        update={
            role: getattr(config, role).model_copy(
                update={
                    "backends": [
                        b.model_copy(
                            update={
                                "host": by_name[b.name].host,
                                "kv_events_endpoint": by_name[b.name].kv_events_endpoint,
                            }
                        )
                        for b in getattr(config, role).backends
                    ]
                }
            )
            for role in ("prefill", "decode")
        }
    )
    router_host = f"{subnet}.1"
    container = _container(by_kind["Deployment"][0])
    argv = [*container["command"], *container.get("args", [])]
    argv[argv.index("--config") + 1] = str(state_dir / ROUTER_CONFIG_FILE)
    # health and config refreshes at a local pace: engines come and go within a second here
    argv += ["--host", router_host, "--port", str(pds.spec.router.port)]
    argv += ["--health-interval", "0.5", "--refresh-interval", "0.5"]
    router = LocalProcess(
        f"{pds.name}-router",
        ComponentRole.ROUTER,
        tuple(_executable(argv)),
        {},
        router_host,
        pds.spec.router.port,
    )
    return LocalPlan(pds.name, pds.namespace, (*engines, router), dump_router_config(local_config))
