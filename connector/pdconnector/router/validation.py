"""Checks on client request bodies: every malformed field becomes a 400 naming the field, never an upstream
5xx."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pdconnector.router.config import MAX_MODEL_LEN_CEILING
from pdconnector.router.errors import bad_request, model_not_found


class Endpoint(StrEnum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class ClientRequest:
    endpoint: Endpoint
    body: dict[str, Any]
    stream: bool


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    return body


def is_json_int(value: object) -> bool:
    """A JSON integer (``True`` parses as an int in Python, not in JSON)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(is_json_int(t) and t >= 0 for t in value)


def _check_prompt(body: dict[str, Any]) -> None:
    if "prompt" not in body:
        raise bad_request("Missing required field 'prompt'", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        return
    if _is_token_list(prompt):
        return
    raise bad_request(
        "'prompt' must be a non-empty string or a non-empty list of non-negative token ids (one prompt per "
        "request)",
        "prompt",
    )


def _check_messages(body: dict[str, Any]) -> None:
    if "messages" not in body:
        raise bad_request("Missing required field 'messages'", "messages")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object", where)
        if not isinstance(message.get("role"), str):
            raise bad_request(f"'{where}.role' must be a string", f"{where}.role")
        content = message.get("content")
        if content is None and message["role"] == "assistant":
            continue  # an assistant turn that only called tools
        if not isinstance(content, str) and not (
            isinstance(content, list) and all(isinstance(part, dict) for part in content)
        ):
            raise bad_request(
                f"'{where}.content' must be a string or a list of content parts", f"{where}.content"
            )


def _context(max_model_len: int | None) -> tuple[int, str]:
    """The most tokens one request may span, and how to name that bound in an error."""
    if max_model_len is None:
        return (
            MAX_MODEL_LEN_CEILING,
            f"the router's ceiling of {MAX_MODEL_LEN_CEILING} tokens (the model's context length is not "
            "configured)",
        )
    return max_model_len, f"the model's context length of {max_model_len} tokens"


def _check_lengths(endpoint: Endpoint, body: dict[str, Any], max_model_len: int | None) -> None:
    """Refuse here what the engines would otherwise try: a runaway output budget occupies a decode engine for
    good."""
    limit, bound = _context(max_model_len)
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is None:
            continue
        if not (is_json_int(value) and value >= 1):
            raise bad_request(f"'{field}' must be a positive integer", field)
        if value > limit:
            raise bad_request(f"'{field}' is {value}, more than {bound}", field)
    prompt = body.get("prompt") if endpoint is Endpoint.COMPLETIONS else None
    if not isinstance(prompt, list):
        return  # text and chat prompts need the model's tokenizer to count: the engine judges those
    # The prefill leg generates one token, so the prompt must leave room for it.
    if len(prompt) >= limit:
        raise bad_request(
            f"'prompt' has {len(prompt)} tokens, which leaves no room for a completion token within {bound}",
            "prompt",
        )
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and len(prompt) + max_tokens > limit:
        raise bad_request(
            f"The prompt's {len(prompt)} tokens plus 'max_tokens' of {max_tokens} exceed {bound}",
            "max_tokens",
        )


def _check_optional_fields(body: dict[str, Any]) -> None:
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise bad_request("'stream' must be a boolean", "stream")
    for field in ("n", "best_of"):
        value = body.get(field)
        if value is None:
            continue
        if not is_json_int(value):
            raise bad_request(f"'{field}' must be an integer", field)
        if value != 1:
            # Prefill's KV moves to decode once, for one sequence; more choices would each need their own.
            raise bad_request(
                f"'{field}' must be 1: each disaggregated request produces one choice (send one request per "
                "choice)",
                field,
            )
    if (
        "stream_options" in body
        and body["stream_options"] is not None
        and not isinstance(body["stream_options"], dict)
    ):
        raise bad_request("'stream_options' must be an object", "stream_options")
    for field in ("temperature", "top_p"):
        if (
            field in body
            and body[field] is not None
            and (isinstance(body[field], bool) or not isinstance(body[field], int | float))
        ):
            raise bad_request(f"'{field}' must be a number", field)
    if "kv_transfer_params" in body:
        raise bad_request(
            "'kv_transfer_params' is set by the router and must not be sent by clients", "kv_transfer_params"
        )


def validate_request(
    endpoint: Endpoint, body: dict[str, Any], served_model: str, *, max_model_len: int | None
) -> ClientRequest:
    """Validate a client body against the endpoint's schema and the served model's context length (None: not
    configured)."""
    model = body.get("model")
    if not isinstance(model, str):
        raise bad_request("Missing or non-string field 'model'", "model")
    if model != served_model:
        raise model_not_found(model)
    if endpoint is Endpoint.COMPLETIONS:
        _check_prompt(body)
    else:
        _check_messages(body)
    _check_optional_fields(body)
    _check_lengths(endpoint, body, max_model_len)
    return ClientRequest(endpoint=endpoint, body=body, stream=bool(body.get("stream")))
