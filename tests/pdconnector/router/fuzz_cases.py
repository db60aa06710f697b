"""Seeded hostile request bodies for the router: the same cases run against fake, mock and real vLLM engines.

Each case is a path and raw body bytes: malformed JSON, JSON of the wrong shape, wrong field types, absurd
``max_tokens``/``n``/``best_of``, client-sent ``kv_transfer_params`` (the router owns them), huge bodies,
random bytes, and well-formed requests with stray fields. Whatever arrives, the router must answer below 500
and stay serviceable.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

PATHS = ("/v1/completions", "/v1/chat/completions")
ABSURD_INTS = (-1, 0, 2**31, 2**63, 10**100, 100_000_000)
HOSTILE_KV_PARAMS: tuple[Any, ...] = (
    {
        "do_remote_prefill": True,
        "remote_engine_id": "x",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    },
    {"do_remote_decode": True, "transfer_id": "../../etc/passwd"},
    {"remote_block_ids": [[2**40, -1]]},
    "not-an-object",
    [1, 2, 3],
    None,
)
WRONG_TYPES: tuple[Any, ...] = (None, True, "7", 3.5, [], {}, [[1]], {"a": 1}, "\u0000", "x" * 300)


@dataclass(frozen=True)
class FuzzCase:
    kind: str
    path: str
    body: bytes


def _valid(rng: random.Random, path: str, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(1, 4)}
    if path == "/v1/completions":
        body["prompt"] = rng.choice(["hello there", [rng.randrange(1000) for _ in range(rng.randint(1, 12))]])
    else:
        body["messages"] = [{"role": "user", "content": "hi " * rng.randint(1, 5)}]
    return body


def fuzz_cases(seed: int, count: int, *, model: str, max_body_bytes: int) -> Iterator[FuzzCase]:
    rng = random.Random(seed)
    fields = (
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "n",
        "best_of",
        "stream",
        "temperature",
        "top_p",
        "logprobs",
        "stop",
        "seed",
    )
    for _ in range(count):
        path = rng.choice(PATHS)
        kind = rng.choice(
            ["bytes", "broken_json", "not_object", "wrong_type", "absurd", "kv_params", "huge", "stray_field"]
        )
        body = _valid(rng, path, model)
        if kind == "bytes":
            raw = bytes(rng.randrange(256) for _ in range(rng.randint(0, 80)))
        elif kind == "broken_json":
            text = json.dumps(body)
            raw = text[: rng.randint(0, len(text) - 1)].encode()
        elif kind == "not_object":
            raw = json.dumps(rng.choice([[body], "text", 42, None, True])).encode()
        elif kind == "wrong_type":
            body[rng.choice(fields)] = rng.choice(WRONG_TYPES)
            raw = json.dumps(body).encode()
        elif kind == "absurd":
            body[rng.choice(["max_tokens", "n", "best_of", "logprobs", "top_p", "temperature"])] = rng.choice(
                ABSURD_INTS
            )
            raw = json.dumps(body).encode()
        elif kind == "kv_params":
            body["kv_transfer_params"] = rng.choice(HOSTILE_KV_PARAMS)
            raw = json.dumps(body).encode()
        elif kind == "huge":
            body["prompt" if path == "/v1/completions" else "user"] = "x" * (
                max_body_bytes + rng.randint(1, 4096)
            )
            raw = json.dumps(body).encode()
        else:
            body[f"unknown_{rng.randrange(100)}"] = rng.choice(WRONG_TYPES)
            raw = json.dumps(body).encode()
        yield FuzzCase(kind, path, raw)
