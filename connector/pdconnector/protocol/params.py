"""The ``kv_transfer_params`` contract between the router and the engines.

The router puts these dictionaries into the body of each leg's OpenAI request;
vLLM hands them to the KV connector as ``Request.kv_transfer_params`` (the mock
engine reads them the same way). Keys shared with upstream vLLM keep upstream's
names so the upstream connectors can be driven by the same router.

Push: both legs are sent at once. Prefill gets ``do_remote_decode`` and the
transfer id; decode gets ``do_remote_prefill``, the transfer id and the prefill
engine's side-channel coordinates so it can register its blocks while prefill
is still computing.

Pull: the prefill leg returns the parameters decode needs (block ids, engine
coordinates); the router forwards them unchanged to the decode leg.

Verification: a decode engine that received KV by transfer says so in the
``pd_received`` entry of its response's ``kv_transfer_params`` (non-streaming),
which the router counts for the operator's KVTransferVerified condition.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

TRANSFER_ID_KEY = "transfer_id"
TRANSFER_MODE_KEY = "transfer_mode"
RECEIVED_KEY = "pd_received"
# What our connector's prefill side answers (HTTP 200) in kv_transfer_params when it keeps no KV for decode.
ERROR_KEY = "pd_error"
# Pull: how long (ms) prefill holds the blocks it returned; decode READs them only within that time of its
# arrival.
REMOTE_HOLD_KEY = "remote_hold_ms"
# Pull: which start of the prefill engine holds the blocks; decode READs them from that one only (a restarted
# engine keeps its engine id, and the same block ids there hold other requests' KV).
REMOTE_INCARNATION_KEY = "remote_incarnation"

# Shared with the wire messages: ids travel in NIXL notifications and log lines, so keep them short and plain.
TRANSFER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
ENGINE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,252}$"
HOST_PATTERN = r"^[A-Za-z0-9.:\[\]%_-]{1,255}$"
INCARNATION_PATTERN = r"^[0-9a-f]{16}$"


class TransferMode(StrEnum):
    PUSH = "push"
    PULL = "pull"


def mint_transfer_id() -> str:
    """A fresh, unguessable transfer id (the router mints one per request)."""
    return "tx-" + secrets.token_hex(12)


def mint_incarnation() -> str:
    """A fresh token for one start of an engine's connector (its side channel serves it)."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class PrefillCoordinates:
    """Where decode finds a prefill engine's connector. ``incarnation``: the start of the engine that must
    answer (a pull's blocks are held by one start only); empty: whichever runs there under ``engine_id``."""

    engine_id: str
    host: str
    side_channel_port: int
    tp_size: int
    incarnation: str = ""


def prefill_leg_params(mode: TransferMode, transfer_id: str) -> dict[str, Any]:
    """Parameters of the prefill leg: compute the prompt, keep the blocks for a remote decode."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        TRANSFER_MODE_KEY: mode.value,
        TRANSFER_ID_KEY: transfer_id,
    }


def push_decode_leg_params(transfer_id: str, prefill: PrefillCoordinates) -> dict[str, Any]:
    """Parameters of a push-mode decode leg, sent concurrently with the prefill leg."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        TRANSFER_MODE_KEY: TransferMode.PUSH.value,
        TRANSFER_ID_KEY: transfer_id,
        "remote_engine_id": prefill.engine_id,
        "remote_host": prefill.host,
        "remote_port": prefill.side_channel_port,
        "tp_size": prefill.tp_size,
    }


def pull_decode_leg_params(prefill_response_params: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """Parameters of a pull-mode decode leg: what prefill returned, pinned to our transfer id."""
    params = dict(prefill_response_params)
    params[TRANSFER_ID_KEY] = transfer_id
    params[TRANSFER_MODE_KEY] = TransferMode.PULL.value
    return params


class EngineRole(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class TransferParamsError(ValueError):
    """``kv_transfer_params`` the router sent are unusable; ``key`` names the offending entry."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"kv_transfer_params[{key!r}]: {problem}")
        self.key = key
        self.problem = problem


@dataclass(frozen=True)
class TransferRequest:
    """Typed view of one leg's ``kv_transfer_params``.

    ``remote`` is set on decode legs (the prefill engine to register with or read from);
    ``remote_block_ids`` (one tuple per KV group) only on pull decode legs.
    """

    mode: TransferMode
    role: EngineRole
    transfer_id: str
    remote: PrefillCoordinates | None = None
    remote_block_ids: tuple[tuple[int, ...], ...] | None = None
    remote_hold_s: float | None = (
        None  # pull: how long prefill holds the blocks after it answered (None: not said)
    )


def _flag(params: Mapping[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise TransferParamsError(key, f"expected a boolean, got {type(value).__name__}")
    return value


def _matching_str(params: Mapping[str, Any], key: str, pattern: str) -> str:
    if key not in params:
        raise TransferParamsError(key, "missing")
    value = params[key]
    if not isinstance(value, str):
        raise TransferParamsError(key, f"expected a string, got {type(value).__name__}")
    if not re.fullmatch(pattern, value):
        raise TransferParamsError(key, f"{value[:64]!r} does not match {pattern}")
    return value


def _int_in(params: Mapping[str, Any], key: str, low: int, high: int) -> int:
    if key not in params:
        raise TransferParamsError(key, "missing")
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TransferParamsError(key, f"expected an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise TransferParamsError(key, f"{value} outside [{low}, {high}]")
    return value


def _block_ids(params: Mapping[str, Any], key: str) -> tuple[tuple[int, ...], ...]:
    """Per-group block ids; a flat list (older upstream format) is one group."""
    if key not in params:
        raise TransferParamsError(key, "missing")
    value = params[key]
    if not isinstance(value, list | tuple):
        raise TransferParamsError(key, f"expected a list, got {type(value).__name__}")
    groups = value if value and all(isinstance(group, list | tuple) for group in value) else [value]
    for group in groups:
        for block in group:
            if isinstance(block, bool) or not isinstance(block, int) or block < 0:
                raise TransferParamsError(key, f"block ids must be non-negative integers, got {block!r}")
    return tuple(tuple(group) for group in groups)


def parse_transfer_params(params: Mapping[str, Any]) -> TransferRequest:
    """Validate the router's ``kv_transfer_params`` for one leg; errors name the offending key."""
    if not isinstance(params, Mapping):
        raise TransferParamsError("kv_transfer_params", f"expected an object, got {type(params).__name__}")
    remote_decode = _flag(params, "do_remote_decode")
    remote_prefill = _flag(params, "do_remote_prefill")
    if remote_decode == remote_prefill:
        raise TransferParamsError(
            "do_remote_prefill", "exactly one of do_remote_prefill and do_remote_decode must be true"
        )
    raw_mode = params.get(TRANSFER_MODE_KEY, TransferMode.PULL.value)
    try:
        mode = TransferMode(raw_mode)
    except ValueError:
        raise TransferParamsError(
            TRANSFER_MODE_KEY, f"{raw_mode!r} is not one of {[m.value for m in TransferMode]}"
        ) from None
    transfer_id = _matching_str(params, TRANSFER_ID_KEY, TRANSFER_ID_PATTERN)
    if remote_decode:
        return TransferRequest(mode=mode, role=EngineRole.PREFILL, transfer_id=transfer_id)
    remote = PrefillCoordinates(
        engine_id=_matching_str(params, "remote_engine_id", ENGINE_ID_PATTERN),
        host=_matching_str(params, "remote_host", HOST_PATTERN),
        side_channel_port=_int_in(params, "remote_port", 1, 65535),
        tp_size=_int_in(params, "tp_size", 1, 1024),
        incarnation=(
            _matching_str(params, REMOTE_INCARNATION_KEY, INCARNATION_PATTERN)
            if REMOTE_INCARNATION_KEY in params
            else ""
        ),
    )
    if mode is TransferMode.PUSH:
        return TransferRequest(mode=mode, role=EngineRole.DECODE, transfer_id=transfer_id, remote=remote)
    hold_ms = _int_in(params, REMOTE_HOLD_KEY, 1, 86_400_000) if REMOTE_HOLD_KEY in params else None
    return TransferRequest(
        mode=mode,
        role=EngineRole.DECODE,
        transfer_id=transfer_id,
        remote=remote,
        remote_block_ids=_block_ids(params, "remote_block_ids"),
        remote_hold_s=None if hold_ms is None else hold_ms / 1000,
    )


# --- Engine answers the router reads (router <-> engine)
# --------------------------------------------------------- Verification, streaming: the engine puts
# ``kv_transfer_params`` (with RECEIVED_KEY) as a top-level field of the final chunk, the one carrying
# ``finish_reason``; the router counts the request as verified if any chunk has it. Non-streaming: the same
# field of the response body. The value of RECEIVED_KEY is a truthy object describing the arrival (the mock
# engine sends ``{"transfer_id", "bytes", "blocks"}``). Failure: an engine that gives up on a transfer answers
# an OpenAI error whose ``error.code`` is one of these, so the router reports it as a transfer failure (502
# ``kv_transfer_failed``) rather than a generic engine error.
TRANSFER_FAILED_CODE = "kv_transfer_failed"
TRANSFER_TIMEOUT_CODE = "kv_transfer_timeout"
TRANSFER_FAILED_CODES = frozenset({TRANSFER_FAILED_CODE, TRANSFER_TIMEOUT_CODE})
