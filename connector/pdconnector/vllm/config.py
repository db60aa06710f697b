"""The connector's settings, read from vLLM's ``--kv-transfer-config`` (pure: no vLLM import).

Shape (what the operator renders, ``pdoperator.render.engine.kv_transfer_config``)::

    {"kv_connector": "PDConnector", "kv_connector_module_path": "pdconnector.vllm.connector",
     "kv_role": "kv_producer|kv_consumer|kv_both", "kv_buffer_device": "cpu|cuda", "engine_id": "...",
     "kv_load_failure_policy": "fail|recompute",
     "kv_connector_extra_config": {"mode": "push|pull", "backends": ["UCX"|"LIBFABRIC"|"mock"],
                                   "side_channel_port": 5600, "transfer_timeout_s": 60}}

Optional extra keys: ``side_channel_host`` (else ``VLLM_NIXL_SIDE_CHANNEL_HOST``, which the
operator sets to the pod IP, else loopback), ``lease_s`` (how long prefill holds finished
blocks for decode, default 30), ``fence_s`` (how long decode keeps a failed push's blocks for a
prefill that never answers; default from the transfer timeout and the default liveness probe,
:func:`pdconnector.protocol.liveness.fence_seconds`), ``heartbeat_dir`` (where the transfer threads
stamp the heartbeat the liveness probe checks; none by default), ``log_timeline`` (true: one log
line per transfer with its stages, :mod:`pdconnector.protocol.timeline`; default false),
``idle_step_wait_s`` (how long a step that runs no request waits for a transfer to end, default 0.002;
vLLM steps such an engine back to back while it waits for KV, a core's worth of CPU; 0 turns the wait
off), ``kv_cache_layout`` (the KV cache layout the connector asks vLLM for, default ``BLHNC``: a block's
pages of every layer are one run, so a request costs one descriptor per block instead of one per
layer per block; ``BHLNC`` keeps a heterogeneous-TP head slice of every layer in one run, for dense
models; backends that accept neither get ``LBHNC``, and the engine logs why), ``staging_mib`` (the
rank's staging buffer for the staged path, ``pdconnector.worker.staging``; default 0: none, every
transfer direct; taken from the device beside the KV cache, the engine logs what it costs in blocks),
``staging_slots`` (transfers one buffer serves at once, default 2), ``transfer_path`` (``auto``: the cost
model picks per request; ``direct`` or ``staged`` force one where the buffers allow it), ``tier_bytes``
(host memory per rank for the KV tier, :mod:`pdconnector.tier`; default 0: no tier; dense models only).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from pdconnector.layout.staging import TransferPath
from pdconnector.protocol.liveness import LivenessProbe, fence_seconds
from pdconnector.protocol.params import ENGINE_ID_PATTERN, HOST_PATTERN, TransferMode

SIDE_CHANNEL_HOST_ENV: Final = "VLLM_NIXL_SIDE_CHANNEL_HOST"
DEFAULT_SIDE_CHANNEL_PORT: Final = 5600
MOCK_BACKEND: Final = "mock"
_KNOWN_KEYS: Final = frozenset(
    {
        "mode",
        "backends",
        "side_channel_port",
        "side_channel_host",
        "transfer_timeout_s",
        "lease_s",
        "fence_s",
        "heartbeat_dir",
        "log_timeline",
        "kv_cache_layout",
        "idle_step_wait_s",
        "staging_mib",
        "staging_slots",
        "transfer_path",
        "tier_bytes",
    }
)
MAX_STAGING_MIB: Final = 1 << 16
MAX_STAGING_SLOTS: Final = 64
MAX_TIER_BYTES: Final = 1 << 42  # 4 TiB of host memory per rank: beyond any machine
TRANSFER_PATHS: Final = ("auto", *(path.value for path in TransferPath))
# vLLM's KVCacheLayout names the connector can move (pdconnector.vllm.kv_layout.SUPPORTED_LAYOUTS maps them).
KV_CACHE_LAYOUTS: Final = ("BLHNC", "BHLNC", "BLNHC", "LBHNC", "LBNHC")
DEFAULT_KV_CACHE_LAYOUT: Final = "BLHNC"
# Long enough to spare the CPU an empty step's work many times over, short enough that a request arriving
# meanwhile waits no more than this to be scheduled.
DEFAULT_IDLE_STEP_WAIT_S: Final = 0.002
MAX_IDLE_STEP_WAIT_S: Final = 0.1


class ConnectorConfigError(ValueError):
    """The ``--kv-transfer-config`` cannot drive the connector; the message names the field."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"kv_transfer_config: {key}: {problem}")
        self.key = key


@dataclass(frozen=True)
class ConnectorConfig:
    engine_id: str
    mode: TransferMode
    backends: tuple[str, ...]
    side_channel_host: str
    side_channel_port: int
    transfer_timeout_s: float
    lease_s: float
    fence_s: float
    heartbeat_dir: str | None
    buffer_device: str
    recompute_on_failure: bool
    log_timeline: bool = False
    kv_cache_layout: str = DEFAULT_KV_CACHE_LAYOUT
    idle_step_wait_s: float = DEFAULT_IDLE_STEP_WAIT_S
    staging_mib: int = 0
    staging_slots: int = 2
    transfer_path: TransferPath | None = None  # None: the cost model chooses
    tier_bytes: int = 0  # host memory per rank for the KV tier; 0: none

    @property
    def uses_mock_transport(self) -> bool:
        return self.backends == (MOCK_BACKEND,)


def parse_connector_config(
    *,
    engine_id: str | None,
    extra: Mapping[str, Any] | None,
    buffer_device: str | None,
    failure_policy: str | None,
    env: Mapping[str, str],
) -> ConnectorConfig:
    """Validate the connector's part of ``--kv-transfer-config``; errors name the offending key."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - _KNOWN_KEYS)
    if unknown:
        raise ConnectorConfigError(
            f"kv_connector_extra_config.{unknown[0]}", f"unknown key (known: {sorted(_KNOWN_KEYS)})"
        )
    if not isinstance(engine_id, str) or not re.fullmatch(ENGINE_ID_PATTERN, engine_id):
        raise ConnectorConfigError("engine_id", f"{engine_id!r} does not match {ENGINE_ID_PATTERN}")
    raw_mode = extra.get("mode", TransferMode.PUSH.value)
    try:
        mode = TransferMode(raw_mode)
    except ValueError:
        raise ConnectorConfigError(
            "kv_connector_extra_config.mode", f"{raw_mode!r} is not one of {[m.value for m in TransferMode]}"
        ) from None
    backends = extra.get("backends", ["UCX"])
    if (
        not isinstance(backends, list | tuple)
        or not backends
        or not all(isinstance(b, str) and b for b in backends)
    ):
        raise ConnectorConfigError(
            "kv_connector_extra_config.backends",
            f"expected a non-empty list of backend names, got {backends!r}",
        )
    if MOCK_BACKEND in backends and len(backends) > 1:
        raise ConnectorConfigError(
            "kv_connector_extra_config.backends", "'mock' cannot be combined with NIXL backends"
        )
    host = extra.get("side_channel_host") or env.get(SIDE_CHANNEL_HOST_ENV) or "127.0.0.1"
    if not isinstance(host, str) or not re.fullmatch(HOST_PATTERN, host):
        raise ConnectorConfigError(
            "kv_connector_extra_config.side_channel_host", f"{host!r} is not a host name or address"
        )
    port = extra.get("side_channel_port", DEFAULT_SIDE_CHANNEL_PORT)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConnectorConfigError(
            "kv_connector_extra_config.side_channel_port", f"expected a port in [1, 65535], got {port!r}"
        )
    device = buffer_device or "cpu"
    if device not in ("cpu", "cuda"):
        raise ConnectorConfigError("kv_buffer_device", f"expected 'cpu' or 'cuda', got {device!r}")
    policy = failure_policy or "fail"
    if policy not in ("fail", "recompute"):
        raise ConnectorConfigError(
            "kv_load_failure_policy", f"expected 'fail' or 'recompute', got {policy!r}"
        )
    heartbeat_dir = extra.get("heartbeat_dir")
    if heartbeat_dir is not None and (
        not isinstance(heartbeat_dir, str) or not heartbeat_dir.startswith("/")
    ):
        raise ConnectorConfigError(
            "kv_connector_extra_config.heartbeat_dir",
            f"expected an absolute directory path, got {heartbeat_dir!r}",
        )
    log_timeline = extra.get("log_timeline", False)
    if not isinstance(log_timeline, bool):
        raise ConnectorConfigError(
            "kv_connector_extra_config.log_timeline", f"expected true or false, got {log_timeline!r}"
        )
    kv_cache_layout = requested_kv_cache_layout(extra)
    timeout_s = _positive(extra, "transfer_timeout_s", 60.0)
    return ConnectorConfig(
        engine_id=engine_id,
        mode=mode,
        backends=tuple(backends),
        side_channel_host=host,
        side_channel_port=port,
        transfer_timeout_s=timeout_s,
        lease_s=_positive(extra, "lease_s", 30.0),
        fence_s=_positive(extra, "fence_s", fence_seconds(timeout_s, LivenessProbe())),
        heartbeat_dir=heartbeat_dir,
        buffer_device=device,
        recompute_on_failure=policy == "recompute",
        log_timeline=log_timeline,
        kv_cache_layout=kv_cache_layout,
        idle_step_wait_s=_idle_step_wait(extra),
        staging_mib=_count(extra, "staging_mib", 0, 0, MAX_STAGING_MIB),
        staging_slots=_count(extra, "staging_slots", 2, 1, MAX_STAGING_SLOTS),
        transfer_path=_transfer_path(extra),
        tier_bytes=_count(extra, "tier_bytes", 0, 0, MAX_TIER_BYTES),
    )


def _count(extra: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConnectorConfigError(
            f"kv_connector_extra_config.{key}", f"expected an integer in [{low}, {high}], got {value!r}"
        )
    return value


def _transfer_path(extra: Mapping[str, Any]) -> TransferPath | None:
    path = extra.get("transfer_path", "auto")
    if path not in TRANSFER_PATHS:
        raise ConnectorConfigError(
            "kv_connector_extra_config.transfer_path", f"expected one of {list(TRANSFER_PATHS)}, got {path!r}"
        )
    return None if path == "auto" else TransferPath(path)


def requested_kv_cache_layout(extra: Mapping[str, Any] | None) -> str:
    """The ``kv_cache_layout`` key, checked: vLLM asks for it before the connector exists."""
    layout = (extra or {}).get("kv_cache_layout", DEFAULT_KV_CACHE_LAYOUT)
    if layout not in KV_CACHE_LAYOUTS:
        raise ConnectorConfigError(
            "kv_connector_extra_config.kv_cache_layout",
            f"expected one of {list(KV_CACHE_LAYOUTS)}, got {layout!r}",
        )
    return layout


def _positive(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 86400:
        raise ConnectorConfigError(
            f"kv_connector_extra_config.{key}", f"expected seconds in (0, 86400], got {value!r}"
        )
    return float(value)


def _idle_step_wait(extra: Mapping[str, Any]) -> float:
    wait = extra.get("idle_step_wait_s", DEFAULT_IDLE_STEP_WAIT_S)
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= MAX_IDLE_STEP_WAIT_S:
        raise ConnectorConfigError(
            "kv_connector_extra_config.idle_step_wait_s",
            f"expected seconds in [0, {MAX_IDLE_STEP_WAIT_S:g}], got {wait!r}",
        )
    return float(wait)
