"""What a failed leg means: whether the request may be tried again on other engines, which engines that try
must avoid, and what the client is told when no try is left (pure functions of the failure)."""

from __future__ import annotations

from dataclasses import dataclass

from pdconnector.protocol.params import TRANSFER_FAILED_CODES, EngineRole
from pdconnector.router import errors
from pdconnector.router.backends import Backend
from pdconnector.router.legs import FailureKind, LegError

# Failures that say nothing about the request itself: the engine was unreachable, broke off, stopped
# answering, was ejected or aborted the request (vLLM at SIGTERM), or kept no KV. Another pair may serve it.
_ENGINE_FAILURES = frozenset(
    {
        FailureKind.CONNECT,
        FailureKind.BROKEN,
        FailureKind.TIMEOUT,
        FailureKind.REPORTED,
        FailureKind.EJECTED,
        FailureKind.ABORTED,
    }
)


def engine_error_code(error: LegError) -> str | None:
    """The ``code`` of an OpenAI-style error body the engine answered, if any."""
    body = (error.body or {}).get("error")
    return body.get("code") if isinstance(body, dict) else None


def transfer_failed(error: LegError) -> bool:
    """Decode answered that the request's KV never arrived (its transfer failed or timed out)."""
    return engine_error_code(error) in TRANSFER_FAILED_CODES


def rejects_request(error: LegError) -> bool:
    """The engine judged the request itself (e.g. a prompt longer than the context): that is the client's to
    fix, and no other engine would judge it differently."""
    return (
        error.kind is FailureKind.STATUS
        and error.status is not None
        and 400 <= error.status < 500
        and error.status not in (401, 403, 404)
    )


@dataclass(frozen=True)
class Retry:
    """A failed attempt that may be tried again: the engines the next attempt must avoid, and why."""

    avoid: tuple[Backend, ...]
    cause: str  # the failure kind, or "kv_transfer" when decode reported the transfer failed


def retry_for(error: LegError, prefill: Backend | None) -> Retry | None:
    """Whether the request whose leg failed with ``error`` (``prefill``: that attempt's prefill) may be tried
    again on other engines, before anything reached its client; None when the failure is the request's own.

    A transfer decode reported failed is laid on the prefill (decode answered; the peer it waited on did not
    deliver), so the retry keeps the choice of decode open."""
    if transfer_failed(error):
        return Retry((prefill,) if prefill is not None else (), "kv_transfer")
    if error.kind in _ENGINE_FAILURES or (error.kind is FailureKind.STATUS and not rejects_request(error)):
        return Retry((error.backend,), error.kind.value)
    return None


def error_for_client(error: LegError, transfer_id: str) -> errors.RouterError:
    """What the client is told about the leg failure that ended its request."""
    role = error.backend.spec.role
    engine = error.backend.describe()
    if error.kind is FailureKind.TIMEOUT:
        phase = "the prefill leg" if role is EngineRole.PREFILL else "decode's answer"
        return errors.RouterError(
            504,
            f"Timed out waiting for {phase} on {engine} for transfer {transfer_id}: {error.detail}",
            "timeout",
            f"{role.value}_timeout",
        )
    if transfer_failed(error):
        return errors.transfer_failed(
            f"{role.value} engine {engine} for transfer {transfer_id}: {error.detail}"
        )
    if rejects_request(error):
        return errors.RouterError(
            error.status or 400,
            f"Rejected by the {role.value} engine: {error.detail}",
            "invalid_request_error",
            f"{role.value}_rejected",
        )
    return errors.upstream_failed(role.value, engine, transfer_id, error.detail)
