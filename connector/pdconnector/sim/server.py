"""The mock engine's HTTP face: vLLM's OpenAI endpoints with ``kv_transfer_params`` handled like vLLM does.

A request spans at most the engine's ``max_model_len`` tokens, prompt and output together, and is refused with
a 400 naming the field otherwise, as vLLM does. A client that goes away stops its generation: pd-mock-engine
serves this app with aiohttp's handler cancellation, and every request closes its generation however it ends.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from pdconnector.protocol.params import TransferParamsError, TransferRequest, parse_transfer_params
from pdconnector.router.legs import sse_data
from pdconnector.router.validation import is_json_int
from pdconnector.sim.engine import COLOCATED, Generation, MockEngine, RoleMismatch
from pdconnector.sim.model import chat_prompt, detokenize, tokenize
from pdconnector.sim.mover import TransferFailed
from pdconnector.sim.pool import OutOfBlocks

DEFAULT_MAX_TOKENS = 16


class EngineError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "code": self.code, "param": self.param}}


def _prompt_tokens(body: dict[str, Any], chat: bool, max_model_len: int) -> list[int]:
    """The prompt's token ids; refused when they leave no room for an output token within
    ``max_model_len``."""
    field = "messages" if chat else "prompt"
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise EngineError(
                400, "'messages' must be a non-empty list of objects", "invalid_messages", field
            )
        source: str | list[Any] = chat_prompt(messages)
    else:
        source = body.get("prompt")
        if not (isinstance(source, str) or (isinstance(source, list) and source)):
            raise EngineError(
                400, "'prompt' must be a string or a non-empty list of token ids", "invalid_prompt", field
            )
    # Text is tokenized only as far as the limit, so a huge prompt is refused without tokenizing all of it.
    tokens = tokenize(source, limit=max_model_len) if isinstance(source, str) else source
    if not tokens:
        raise EngineError(400, "the prompt has no tokens", "empty_prompt", field)
    if len(tokens) >= max_model_len:
        count = f"at least {max_model_len}" if isinstance(source, str) else str(len(tokens))
        raise EngineError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{count} input tokens, "
            f"which leaves no room for any output token. Please reduce the length of the {field}.",
            "context_length_exceeded",
            field,
        )
    if not all(is_json_int(t) and t >= 0 for t in tokens):
        raise EngineError(
            400, "'prompt' must be a string or a non-empty list of token ids", "invalid_prompt", field
        )
    return list(tokens)


def _max_tokens(body: dict[str, Any], prompt_tokens: int, max_model_len: int, prompt_field: str) -> int:
    """How many tokens to generate: the request's output budget, which must fit in the context after the
    prompt."""
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(field)
    room = max_model_len - prompt_tokens
    if value is None:
        return min(DEFAULT_MAX_TOKENS, room)
    if not is_json_int(value) or value < 1:
        raise EngineError(
            400, f"'{field}' must be a positive integer, got {value!r}", "invalid_max_tokens", field
        )
    if value > room:
        raise EngineError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + value} tokens "
            f"({prompt_tokens} in the {prompt_field}, {value} in '{field}'). Please reduce the length of "
            f"the {prompt_field} or '{field}'.",
            "context_length_exceeded",
            field,
        )
    return value


def _transfer(body: dict[str, Any]) -> TransferRequest | None:
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    try:
        return parse_transfer_params(params)
    except TransferParamsError as error:
        raise EngineError(400, str(error), "invalid_kv_transfer_params") from error


class _Formatter:
    """OpenAI response shapes for one request (completion or chat)."""

    def __init__(self, chat: bool, model: str, request_id: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())

    def _envelope(self, stream: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if stream and self.chat else ""
        )
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(
        self, text: str, token_ids: list[int], prompt_tokens: int, transfer_params: dict[str, Any] | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["token_ids"] = token_ids
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(token_ids),
            "total_tokens": prompt_tokens + len(token_ids),
        }
        return {
            **self._envelope(False),
            "choices": [choice],
            "usage": usage,
            "kv_transfer_params": transfer_params,
        }

    def chunk(self, text: str | None, finish_reason: str | None, first: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return {**self._envelope(True), "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return {**self._envelope(True), "choices": [], "usage": usage}


async def _stream(
    request: web.Request,
    response: web.StreamResponse,
    generation: Generation,
    formatter: _Formatter,
    include_usage: bool,
) -> None:
    """Sends the generation as server-sent events, one chunk per token as it is generated (nothing
    accumulates)."""
    await response.prepare(request)
    if formatter.chat:
        await response.write(sse_data(formatter.chunk(None, None, first=True)))
    produced = 0
    pending: int | None = None
    async for token in generation.tokens:
        if pending is not None:
            await response.write(sse_data(formatter.chunk(detokenize(pending), None)))
        pending = token
        produced += 1
    last = formatter.chunk(detokenize(pending) if pending is not None else "", "length")
    if generation.transfer_params is not None:
        # Streaming verification (see protocol.params): the final chunk carries kv_transfer_params.
        last["kv_transfer_params"] = generation.transfer_params
    await response.write(sse_data(last))
    if include_usage:
        await response.write(sse_data(formatter.usage_chunk(generation.prompt_tokens, produced)))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()


async def _generation_for(engine: MockEngine, body: dict[str, Any], chat: bool) -> Generation:
    max_model_len = engine.settings.max_model_len
    prompt = _prompt_tokens(body, chat, max_model_len)
    max_tokens = _max_tokens(body, len(prompt), max_model_len, "messages" if chat else "prompt")
    transfer = _transfer(body)
    try:
        return await engine.run(prompt, max_tokens, transfer)
    except RoleMismatch as error:
        raise EngineError(400, str(error), "wrong_role") from error
    except OutOfBlocks as error:
        raise EngineError(503, f"KV cache full: {error}", "kv_cache_full") from error
    except TransferFailed as error:
        raise EngineError(504 if error.code.endswith("timeout") else 502, error.detail, error.code) from error


def _parse(raw: bytes, model: str) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise EngineError(400, f"body is not JSON: {error}", "invalid_json") from error
    if not isinstance(body, dict):
        raise EngineError(400, "body must be a JSON object", "invalid_json")
    if body.get("model") != model:
        raise EngineError(404, f"The model '{body.get('model')}' does not exist", "model_not_found")
    return body


async def handle_completion(
    request: web.Request, engine: MockEngine, model: str, chat: bool
) -> web.StreamResponse:
    kind = "chat" if chat else "completion"
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    headers = {"X-Request-Id": request_id, "x-pd-engine": engine.settings.engine_id}
    response: web.StreamResponse | None = None
    try:
        body = _parse(await request.read(), model)
        generation = await _generation_for(engine, body, chat)
        formatter = _Formatter(chat, model, request_id)
        try:
            if body.get("stream"):
                options = body.get("stream_options") or {}
                response = web.StreamResponse(
                    headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await _stream(request, response, generation, formatter, bool(options.get("include_usage")))
            else:
                token_ids = [token async for token in generation.tokens]
                text = "".join(detokenize(t) for t in token_ids)
                response = web.json_response(
                    formatter.whole(text, token_ids, generation.prompt_tokens, generation.transfer_params),
                    headers=headers,
                )
        finally:
            # Stops generating and frees the request's blocks on every path, the client going away included.
            await generation.aclose()
    except EngineError as error:
        engine.metrics.requests.labels(kind, "error").inc()
        return web.json_response(error.body(), status=error.status, headers=headers)
    except asyncio.CancelledError:
        # aiohttp cancels the handler when the client disconnects (handler_cancellation in main).
        engine.metrics.requests.labels(kind, "cancelled").inc()
        raise
    except ConnectionResetError:
        # The client disconnected mid-stream and a write noticed first; aiohttp expects the broken response
        # back.
        engine.metrics.requests.labels(kind, "cancelled").inc()
        if response is None:
            raise
        return response
    engine.metrics.requests.labels(kind, "ok").inc()
    return response


def create_engine_app(engine: MockEngine, model: str, compat_hash: str | None = None) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    metrics = engine.metrics

    def completion_handler(chat: bool) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await handle_completion(request, engine, model, chat)

        return handle

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": model, "object": "model", "created": 0, "owned_by": "pd-mock-engine"}],
            }
        )

    async def health(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "engine_id": engine.settings.engine_id,
                "role": engine.settings.role or COLOCATED,
                "compat_hash": compat_hash,
                "kv_device": engine.pool.device.value,
            }
        )

    async def tokenize_handler(request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: what the cache-aware router hashes a text or chat prompt from."""
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise EngineError(400, "the body must be a JSON object", "invalid_body", None)
            tokens = _prompt_tokens(body, "messages" in body, engine.settings.max_model_len)
        except ValueError:
            return web.json_response(
                EngineError(400, "the body is not JSON", "invalid_body", None).body(), status=400
            )
        except EngineError as error:
            return web.json_response(error.body(), status=error.status)
        return web.json_response(
            {"count": len(tokens), "max_model_len": engine.settings.max_model_len, "tokens": tokens}
        )

    async def metrics_handler(_: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), content_type="text/plain", charset="utf-8")

    async def lifecycle(_: web.Application) -> AsyncIterator[None]:
        if engine.mover is not None:
            await engine.mover.start()
        yield
        if engine.mover is not None:
            await engine.mover.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", completion_handler(chat=False))
    app.router.add_post("/v1/chat/completions", completion_handler(chat=True))
    app.router.add_post("/tokenize", tokenize_handler)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_handler)
    return app
