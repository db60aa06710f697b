"""What each leg sends and what its answer says: pure functions of the JSON bodies."""

from __future__ import annotations

from typing import Any

from pdconnector.protocol.params import ERROR_KEY, RECEIVED_KEY
from pdconnector.router.status import Evidence
from pdconnector.router.validation import Endpoint


def upstream_engine_request_id(endpoint: Endpoint, request_id: str) -> str:
    """The id vLLM's OpenAI server gives the prefill leg sent with ``X-Request-Id: request_id``.

    Upstream's push connector pairs decode with that prefill request by this id (its random engine suffix
    stripped); both legs carry the same ``X-Request-Id``. A completion has one prompt, index 0.
    """
    return f"chatcmpl-{request_id}" if endpoint is Endpoint.CHAT else f"cmpl-{request_id}-0"


def prefill_error(answer: dict[str, Any]) -> str | None:
    params = answer.get("kv_transfer_params")
    if isinstance(params, dict) and ERROR_KEY in params:
        return str(params[ERROR_KEY])
    return None


def aborted(payload: dict[str, Any] | None) -> bool:
    """The engine aborted the request instead of finishing it (vLLM answers ``finish_reason: "abort"`` for
    requests it drops at shutdown): nothing it returned can be used."""
    choices = payload.get("choices") if payload else None
    return isinstance(choices, list) and any(
        isinstance(choice, dict) and choice.get("finish_reason") == "abort" for choice in choices
    )


def prefill_body(client_body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    body = {
        k: v
        for k, v in client_body.items()
        if k not in ("stream", "stream_options", "min_tokens", "max_completion_tokens")
    }
    body["max_tokens"] = 1
    body["stream"] = False
    body["kv_transfer_params"] = params
    return body


def decode_body(client_body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    return {**client_body, "kv_transfer_params": params}


def transfer_report(payload: dict[str, Any] | None) -> Evidence | None:
    """What one decode answer (a JSON body or a stream event) says about its KV; None when it has no
    kv_transfer_params.

    vLLM's whole answers always carry the field (null when no KV arrived), so its absence proves nothing:
    vLLM's streams never carry it, while the mock engine's put it in their final event."""
    if not payload or "kv_transfer_params" not in payload:
        return None
    params = payload["kv_transfer_params"]
    return Evidence.VERIFIED if isinstance(params, dict) and params.get(RECEIVED_KEY) else Evidence.UNVERIFIED


def stronger_evidence(a: Evidence | None, b: Evidence | None) -> Evidence | None:
    """A stream's report: one event with the receipt verifies it, one with the field and no receipt leaves it
    unverified."""
    return Evidence.VERIFIED if Evidence.VERIFIED in (a, b) else a or b


def stream_error(payload: dict[str, Any] | None) -> dict[str, Any] | None:
    error = payload.get("error") if payload else None
    return error if isinstance(error, dict) else None
