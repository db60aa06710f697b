"""A request's prompt token ids, as the engine will see them: token prompts as they are, text and chat
through an engine's own ``/tokenize`` (the same tokenizer and chat template the engine applies, so the
router's block hashes match the engine's).

Tokenizing costs one round trip before the legs start; when it fails or is slow the request is routed on
load alone rather than delayed.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp

from pdconnector.router.backends import Backend
from pdconnector.router.validation import ClientRequest, Endpoint, is_json_int

log = logging.getLogger(__name__)

TOKENIZE_TIMEOUT_S = 2.0
# What vLLM's /tokenize takes for a chat request besides the messages: whatever changes the rendered prompt.
_CHAT_TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "mm_processor_kwargs",
)


def tokenize_body(request: ClientRequest) -> dict[str, Any] | None:
    """The ``/tokenize`` body that renders this request's prompt; None when its prompt is token ids already
    (see :func:`given_token_ids`)."""
    body = request.body
    if request.endpoint is Endpoint.CHAT:
        return {
            "model": body.get("model"),
            "messages": body["messages"],
            **{key: body[key] for key in _CHAT_TEMPLATE_FIELDS if key in body},
        }
    if isinstance(body.get("prompt"), str):
        return {
            "model": body.get("model"),
            "prompt": body["prompt"],
            **({"add_special_tokens": body["add_special_tokens"]} if "add_special_tokens" in body else {}),
        }
    return None


def given_token_ids(request: ClientRequest) -> list[int] | None:
    prompt = request.body.get("prompt")
    if request.endpoint is Endpoint.COMPLETIONS and isinstance(prompt, list):
        return [int(token) for token in prompt]
    return None


async def prompt_token_ids(
    session: aiohttp.ClientSession, engine: Backend | None, request: ClientRequest
) -> list[int] | None:
    """The prompt's token ids, asking ``engine`` to tokenize text; None when that is not possible now."""
    if (given := given_token_ids(request)) is not None:
        return given
    body = tokenize_body(request)
    if body is None or engine is None:
        return None
    try:
        async with session.post(
            engine.spec.base_url + "/tokenize",
            json=body,
            timeout=aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S),
        ) as resp:
            answer = await resp.json(content_type=None) if resp.status == 200 else None
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as error:
        reason = f"{type(error).__name__}: {error}"
        log.info("tokenize failed", extra={"backend": engine.name, "error": reason})
        return None
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not all(is_json_int(t) for t in tokens):
        log.info("tokenize gave no token ids", extra={"backend": engine.name})
        return None
    return tokens
