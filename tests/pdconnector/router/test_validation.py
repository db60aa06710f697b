"""Request bounds: the router refuses what the model cannot serve with a 400 naming the field, before any
engine sees it.

A request asking for more tokens than the model's context (spec.model.maxModelLen) once wedged a decode engine
and with it the whole service; such requests end at the router.
"""

from __future__ import annotations

import pytest
from pdconnector.router.config import MAX_MODEL_LEN_CEILING

MODEL = "tiny"
MAX_MODEL_LEN = 64


def completion(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": "hello there", **fields}


def chat(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **fields}


def token_prompt(length: int, **fields: object) -> dict[str, object]:
    return completion(prompt=list(range(length)), **fields)


REFUSED = {
    "max_tokens from the issue": ("/v1/completions", completion(max_tokens=100_000_000), "max_tokens"),
    "max_tokens one past the context": (
        "/v1/completions",
        completion(max_tokens=MAX_MODEL_LEN + 1),
        "max_tokens",
    ),
    "max_tokens zero": ("/v1/completions", completion(max_tokens=0), "max_tokens"),
    "max_tokens negative": ("/v1/completions", completion(max_tokens=-1), "max_tokens"),
    "max_tokens a float": ("/v1/completions", completion(max_tokens=2.0), "max_tokens"),
    "max_tokens a string": ("/v1/completions", completion(max_tokens="7"), "max_tokens"),
    "max_tokens a boolean": ("/v1/completions", completion(max_tokens=True), "max_tokens"),
    "chat max_tokens past the context": (
        "/v1/chat/completions",
        chat(max_tokens=MAX_MODEL_LEN + 1),
        "max_tokens",
    ),
    "chat max_completion_tokens past the context": (
        "/v1/chat/completions",
        chat(max_completion_tokens=MAX_MODEL_LEN + 1),
        "max_completion_tokens",
    ),
    "chat max_completion_tokens zero": (
        "/v1/chat/completions",
        chat(max_completion_tokens=0),
        "max_completion_tokens",
    ),
    "chat max_completion_tokens a float": (
        "/v1/chat/completions",
        chat(max_completion_tokens=1.5),
        "max_completion_tokens",
    ),
    "token prompt filling the context": ("/v1/completions", token_prompt(MAX_MODEL_LEN), "prompt"),
    "token prompt plus max_tokens past the context": (
        "/v1/completions",
        token_prompt(60, max_tokens=5),
        "max_tokens",
    ),
    "n of 2": ("/v1/completions", completion(n=2), "n"),
    "n of 0": ("/v1/chat/completions", chat(n=0), "n"),
    "n a float equal to 1": ("/v1/completions", completion(n=1.0), "n"),
    "n a boolean": ("/v1/completions", completion(n=True), "n"),
    "n a string": ("/v1/chat/completions", chat(n="1"), "n"),
    "best_of of 3": ("/v1/completions", completion(best_of=3), "best_of"),
}


@pytest.mark.parametrize(("path", "body", "field"), list(REFUSED.values()), ids=list(REFUSED))
async def test_a_request_beyond_what_the_model_serves_is_a_400_naming_the_field(
    cluster, make_router, path, body, field
):
    client = await make_router(max_model_len=MAX_MODEL_LEN)
    response = await client.post(path, json=body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "invalid_request",
        field,
    )
    assert f"'{field}'" in error["message"]
    assert not any(e.bodies for e in cluster.prefill + cluster.decode)


ACCEPTED = {
    "max_tokens at the context": ("/v1/completions", completion(max_tokens=MAX_MODEL_LEN)),
    "token prompt plus max_tokens exactly at the context": (
        "/v1/completions",
        token_prompt(60, max_tokens=4),
    ),
    "longest token prompt, no max_tokens": ("/v1/completions", token_prompt(MAX_MODEL_LEN - 1)),
    "chat max_completion_tokens at the context": (
        "/v1/chat/completions",
        chat(max_completion_tokens=MAX_MODEL_LEN),
    ),
    "n of 1 and null budgets": ("/v1/completions", completion(n=1, best_of=None, max_tokens=None)),
}


@pytest.mark.parametrize(("path", "body"), list(ACCEPTED.values()), ids=list(ACCEPTED))
async def test_a_request_within_the_context_is_served(cluster, make_router, path, body):
    client = await make_router(max_model_len=MAX_MODEL_LEN)
    response = await client.post(path, json=body)
    assert response.status == 200, await response.text()


async def test_the_error_says_what_the_bound_is(make_router):
    client = await make_router(max_model_len=MAX_MODEL_LEN)
    error = (await (await client.post("/v1/completions", json=token_prompt(60, max_tokens=5))).json())[
        "error"
    ]
    assert (
        error["message"]
        == "The prompt's 60 tokens plus 'max_tokens' of 5 exceed the model's context length of 64 tokens"
    )


async def test_without_a_configured_context_length_the_ceiling_still_bounds_requests(cluster, make_router):
    client = await make_router()  # max_model_len unset: the engines know the model's own length
    refused = await client.post("/v1/completions", json=completion(max_tokens=MAX_MODEL_LEN_CEILING + 1))
    assert refused.status == 400
    error = (await refused.json())["error"]
    assert error["param"] == "max_tokens" and "not configured" in error["message"]
    assert not any(e.bodies for e in cluster.prefill + cluster.decode)
    # Anything under the ceiling is the engine's to judge against the model's real length.
    assert (await client.post("/v1/completions", json=completion(max_tokens=100_000))).status == 200
