"""Fuzzing the router's API: whatever a client sends, the answer is never a 5xx (engines are healthy here)."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "tiny"

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
fields = st.sampled_from(
    [
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "stream",
        "stream_options",
        "n",
        "temperature",
        "top_p",
        "max_completion_tokens",
    ]
)
valid_values = {
    "model": st.just(MODEL),
    "prompt": st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 1023), min_size=1, max_size=8),
    "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=20)}),
        min_size=1,
        max_size=3,
    ),
    "max_tokens": st.integers(1, 8),
    "stream": st.booleans(),
}


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["mutated", "random_json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "random_json":
        return json.dumps(draw(json_values)).encode()
    body = {name: draw(strategy) for name, strategy in valid_values.items() if draw(st.booleans())}
    for _ in range(draw(st.integers(0, 3))):
        body[draw(fields)] = draw(json_values)
    return json.dumps(body).encode()


def post(base: str, path: str, body: bytes) -> tuple[int, bytes]:
    url = urlsplit(base)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=bodies())
def test_no_request_body_makes_the_router_answer_5xx(threaded_router, path, body):
    status, answer = post(threaded_router, path, body)
    assert status < 500, answer
    if status >= 400:
        error = json.loads(answer)["error"]
        assert error["message"] and error["code"]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(4097, 20000))
def test_oversized_bodies_get_413(threaded_router, size):
    status, _ = post(
        threaded_router, "/v1/completions", json.dumps({"model": MODEL, "prompt": "x" * size}).encode()
    )
    assert status == 413
