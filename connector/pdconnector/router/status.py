"""``GET /status``: backends, their health, and how many requests decode confirmed were served by a KV
transfer."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pdconnector.router.backends import BackendPool


class Evidence(StrEnum):
    """What a successful request's decode answer says about its KV."""

    VERIFIED = "verified"  # decode confirmed KV arrived by transfer
    # the answer reports on its KV and no receipt is in it: decode computed the prompt itself
    UNVERIFIED = "unverified"
    UNCONFIRMABLE = (
        "unconfirmable"  # the answer says nothing either way (upstream vLLM connectors; vLLM's streams)
    )


@dataclass
class TransferLedger:
    """Successful requests since the router started, by :class:`Evidence`."""

    verified: int = 0
    unverified: int = 0
    unconfirmable: int = 0

    def record(self, evidence: Evidence) -> None:
        setattr(self, evidence.value, getattr(self, evidence.value) + 1)


def build_status(
    pool: BackendPool, ledger: TransferLedger, mode: str, served_model: str, policy: str
) -> dict[str, object]:
    return {
        "mode": mode,
        "model": served_model,
        "policy": policy,
        "ready": pool.is_ready(),
        "backends": [backend.status() for backend in pool.all()],
        "transfers": {
            "verified": ledger.verified,
            "unverified": ledger.unverified,
            "unconfirmable": ledger.unconfirmable,
        },
    }
