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

import secrets
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

TRANSFER_ID_KEY = "transfer_id"
TRANSFER_MODE_KEY = "transfer_mode"
RECEIVED_KEY = "pd_received"


class TransferMode(StrEnum):
    PUSH = "push"
    PULL = "pull"


def mint_transfer_id() -> str:
    """A fresh, unguessable transfer id (the router mints one per request)."""
    return "tx-" + secrets.token_hex(12)


@dataclass(frozen=True)
class PrefillCoordinates:
    """Where decode finds a prefill engine's connector."""

    engine_id: str
    host: str
    side_channel_port: int
    tp_size: int


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
