"""Through the router with the official openai client: outputs identical to a co-located engine, for both
modes."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import aiohttp
import openai
import pytest
from pdconnector.sim.model import chat_prompt, reference_tokens, tokenize

MODEL = "tiny"


def status(url: str) -> dict:
    with urllib.request.urlopen(url + "/status", timeout=5) as response:
        return json.loads(response.read())


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def assert_no_blocks_held(cluster) -> None:
    """Every block is back and none was freed by a lease running out (a lost notice).

    Prefill frees after the response went out (when decode's notice is polled), so allow a moment,
    well short of the fast cluster's 5 s lease."""
    for engine in cluster.engines.values():
        deadline = time.monotonic() + 2.0
        while True:
            samples = engine.metrics()
            if (
                samples["pd_mock_kv_blocks_free"] == samples["pd_mock_kv_blocks_total"]
                or time.monotonic() > deadline
            ):
                break
            time.sleep(0.05)
        assert samples["pd_mock_kv_blocks_free"] == samples["pd_mock_kv_blocks_total"], engine.name
        assert samples["pd_mock_kv_blocks_held_for_transfer"] == 0, engine.name
        expired = {name: value for name, value in samples.items() if "outcome=expired" in name and value}
        assert not expired, f"{engine.name}: transfers ended by a lease, not by decode: {expired}"


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("stream", [False, True])
def test_completion_equals_colocated_and_is_served_by_distinct_engines(fast_cluster, mode, stream):
    router = client_for(fast_cluster.routers[mode].url)
    reference = client_for(fast_cluster.engines["colocated"].url)
    prompt = f"the quick brown fox {mode} {stream}"
    expected = reference.completions.create(model=MODEL, prompt=prompt, max_tokens=12).choices[0].text
    raw = router.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=12, stream=stream
    )
    assert raw.headers["x-pd-prefill"].startswith("prefill-") and raw.headers["x-pd-decode"].startswith(
        "decode-"
    )
    answer = raw.parse()
    text = (
        "".join(chunk.choices[0].text for chunk in answer if chunk.choices)
        if stream
        else answer.choices[0].text
    )
    assert text == expected


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_colocated(fast_cluster, mode, stream):
    router = client_for(fast_cluster.routers[mode].url)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": f"hello {mode} {stream}"},
    ]
    expected = "".join(f" t{t}" for t in reference_tokens(tokenize(chat_prompt(messages)), 7))
    answer = router.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, stream=stream)
    text = (
        "".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices)
        if stream
        else answer.choices[0].message.content
    )
    assert text == expected


def test_every_successful_request_was_verified_and_no_blocks_are_held(fast_cluster):
    for mode in ("push", "pull"):
        client_for(fast_cluster.routers[mode].url).completions.create(
            model=MODEL, prompt="count me", max_tokens=2
        )
        transfers = status(fast_cluster.routers[mode].url)["transfers"]
        assert transfers["verified"] >= 1 and transfers["unverified"] == 0
    assert_no_blocks_held(fast_cluster)


def test_unknown_model_and_bad_input_are_client_errors(fast_cluster):
    router = client_for(fast_cluster.routers["push"].url)
    with pytest.raises(openai.NotFoundError):
        router.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        router.completions.create(model=MODEL, prompt="x", max_tokens=0)
    # The request that once wedged a decode engine ends at the router, and the next one is served.
    with pytest.raises(openai.BadRequestError, match="'max_tokens' is 100000000"):
        router.completions.create(model=MODEL, prompt="x", max_tokens=100_000_000)
    assert router.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text


async def _load(url: str, count: int, concurrency: int) -> list[tuple[str, int, dict]]:
    semaphore = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def one(index: int) -> tuple[str, int, dict]:
            async with semaphore:
                body = {"model": MODEL, "prompt": f"load request number {index}", "max_tokens": 4}
                async with session.post(
                    url + "/v1/completions", json=body, headers={"X-Request-Id": f"load-{index}"}
                ) as response:
                    return response.headers["X-Request-Id"], response.status, await response.json()

        return await asyncio.gather(*(one(i) for i in range(count)))


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_load_2000_requests_at_concurrency_64_loses_and_duplicates_nothing(fast_cluster, mode):
    count = 2000
    results = asyncio.run(_load(fast_cluster.routers[mode].url, count, 64))
    assert sorted(request_id for request_id, _, _ in results) == sorted(f"load-{i}" for i in range(count))
    for request_id, code, body in results:
        index = int(request_id.removeprefix("load-"))
        assert code == 200, body
        assert body["choices"][0]["token_ids"] == reference_tokens(
            tokenize(f"load request number {index}"), 4
        )
    assert_no_blocks_held(fast_cluster)
