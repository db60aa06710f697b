"""OpenAI-style errors: every failure the router reports has a status, a type, a code and a message."""

from __future__ import annotations

from aiohttp import web


class RouterError(Exception):
    """A failure to report to the client as ``{"error": {"message", "type", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str,
        code: str,
        param: str | None = None,
        *,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "code": self.code,
                "param": self.param,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> RouterError:
    return RouterError(400, message, "invalid_request_error", "invalid_request", param)


def model_not_found(model: str) -> RouterError:
    return RouterError(
        404,
        f"The model '{model}' does not exist on this router",
        "invalid_request_error",
        "model_not_found",
        "model",
    )


def unauthorized() -> RouterError:
    return RouterError(
        401,
        "Missing or invalid API key: send 'Authorization: Bearer <key>'",
        "authentication_error",
        "invalid_api_key",
    )


def body_too_large(limit: int) -> RouterError:
    return RouterError(
        413, f"Request body exceeds the limit of {limit} bytes", "invalid_request_error", "request_too_large"
    )


def no_backend(role: str, reasons: list[str], retry_after_s: int) -> RouterError:
    """``reasons``: why each backend of the role cannot take the request, so the client (and its operator)
    sees what is wrong."""
    why = "; ".join(reasons) if reasons else f"no {role} backend is configured"
    return RouterError(
        503,
        f"No healthy {role} backend is available: {why}",
        "service_unavailable",
        f"no_{role}_backend",
        headers={"Retry-After": str(retry_after_s)},
    )


def upstream_failed(role: str, backend: str, transfer_id: str, detail: str) -> RouterError:
    return RouterError(
        502,
        f"The {role} leg failed on {backend} for transfer {transfer_id}: {detail}",
        "upstream_error",
        f"{role}_failed",
    )


def transfer_failed(detail: str) -> RouterError:
    return RouterError(502, f"KV transfer failed: {detail}", "upstream_error", "kv_transfer_failed")


def timed_out(phase: str, seconds: float) -> RouterError:
    return RouterError(
        504,
        f"Timed out after {seconds:g} s waiting for {phase}",
        "timeout",
        f"{phase.replace(' ', '_')}_timeout",
    )
