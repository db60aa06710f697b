"""``GET /status``: backends, their health, and how many requests decode confirmed were served by a KV transfer."""

from __future__ import annotations

from dataclasses import dataclass

from pdconnector.router.backends import BackendPool


@dataclass
class TransferLedger:
    """Verified: decode said KV arrived by transfer. Unverified: the request succeeded without that confirmation."""

    verified: int = 0
    unverified: int = 0

    def record(self, confirmed: bool) -> None:
        if confirmed:
            self.verified += 1
        else:
            self.unverified += 1


def build_status(pool: BackendPool, ledger: TransferLedger, mode: str, served_model: str) -> dict[str, object]:
    return {
        "mode": mode,
        "model": served_model,
        "ready": pool.is_ready(),
        "backends": [backend.status() for backend in pool.all()],
        "transfers": {"verified": ledger.verified, "unverified": ledger.unverified},
    }
