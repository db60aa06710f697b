"""Faults with real processes: each gives the client a clear error or a retry, and no engine keeps blocks."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import httpx
import openai
import pytest

from tests.pdconnector.router.e2e.checks import (
    all_healthy,
    backend_health,
    blocks_all_free,
    retries_counted,
    wait_until,
)

MODEL = "tiny"


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=2) as response:
            return response.status == 200 and json.loads(response.read())["ready"]
    except OSError:
        return False


@pytest.fixture
def cluster(slow_cluster):
    """The slow cluster, healed after each test: killed engines restarted and routers' health checks caught
    up."""
    yield slow_cluster
    for name, engine in slow_cluster.engines.items():
        if not engine.alive:
            slow_cluster.restart(name)
    for router in slow_cluster.routers.values():
        wait_until(lambda url=router.url: all_healthy(url))
    wait_until(lambda: blocks_all_free(slow_cluster))


FROZEN_PREFILL_BOUND_S = 15.0  # the last of the requests caught by a freeze is served within this


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_with_one_of_two_prefills_frozen_twelve_concurrent_requests_all_succeed_soon_after(cluster, mode):
    """SIGSTOP one prefill: the requests sent to it before the router's health checks eject it end at the
    ejection and are retried on the other prefill, with new transfers; none waits for a leg timeout."""
    router = client_for(cluster.routers[mode].url)
    frozen = cluster.engines["prefill-0"]
    outcomes: list[tuple[str, float] | BaseException] = []
    lock = threading.Lock()

    def call(index: int) -> None:
        try:
            raw = router.completions.with_raw_response.create(
                model=MODEL, prompt=f"frozen neighbour {index}", max_tokens=4
            )
            raw.parse()
            result: tuple[str, float] | BaseException = (raw.headers["x-pd-prefill"], time.monotonic())
        except openai.APIError as error:
            result = error
        with lock:
            outcomes.append(result)

    frozen.pause()
    frozen_at = time.monotonic()
    try:
        callers = [threading.Thread(target=call, args=(i,)) for i in range(12)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(timeout=FROZEN_PREFILL_BOUND_S + 15)
    finally:
        frozen.resume()
    failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    assert len(outcomes) == 12 and failures == [], failures
    served = [outcome for outcome in outcomes if not isinstance(outcome, BaseException)]
    assert {prefill for prefill, _ in served} == {"prefill-1"}
    last = max(at for _, at in served) - frozen_at
    print(f"{mode}: 12 of 12 served with prefill-0 frozen, the last {last:.2f} s after the freeze")
    assert last < FROZEN_PREFILL_BOUND_S


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_decode_killed_mid_stream_ends_the_stream_with_an_error(cluster, mode):
    router = client_for(cluster.routers[mode].url)
    raw = router.completions.with_raw_response.create(
        model=MODEL, prompt="a long story", max_tokens=500, stream=True
    )
    stream = raw.parse()
    next(iter(stream))
    cluster.engines[raw.headers["x-pd-decode"]].kill()
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in stream:
            pass
    wait_until(lambda: blocks_all_free(cluster))


def test_prefill_killed_before_transfer_gives_a_clear_error_and_frees_decode(cluster):
    router = client_for(cluster.routers["push"].url)
    prompt = " ".join(f"t{i % 1000}" for i in range(1500))  # 3 s of prefill at 2 ms per token
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            router.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        except openai.APIError as error:
            outcome.append(error)

    caller = threading.Thread(target=call)
    caller.start()
    wait_until(
        lambda: any(
            e.metrics()["pd_mock_kv_blocks_free"] < e.metrics()["pd_mock_kv_blocks_total"]
            for e in cluster.engines.values()
            if e.role == "prefill"
        )
    )
    for engine in cluster.engines.values():
        if engine.role == "prefill":
            engine.kill()
    caller.join(timeout=20)
    assert len(outcome) == 1
    # Both prefills are gone, so the retry on the other one fails too. Whichever the router notices last is
    # the answer: a prefill leg that broke, a transfer decode reported failed, or (once the dead prefills were
    # ejected) a refusal naming both.
    assert isinstance(outcome[0], openai.APIStatusError), outcome
    assert (
        outcome[0].status_code,
        any(
            clue in str(outcome[0])
            for clue in ("prefill leg failed", "KV transfer failed", "No healthy prefill backend")
        ),
    ) in ((502, True), (503, True)), str(outcome[0])
    wait_until(lambda: blocks_all_free(cluster))


def test_push_with_every_prefill_down_is_a_prompt_503_naming_them_then_served_once_they_return(cluster):
    for name in ("prefill-0", "prefill-1"):
        cluster.engines[name].kill()
    router = client_for(cluster.routers["push"].url)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        router.completions.create(model=MODEL, prompt="anyone there", max_tokens=2)
    assert time.monotonic() - started < 1.0  # the engines' transfer timeout is 2 s: nothing waited for KV
    assert refused.value.status_code == 503
    assert "prefill-0: ejected" in refused.value.message and "prefill-1: ejected" in refused.value.message
    for name in ("prefill-0", "prefill-1"):
        cluster.restart(name)
    wait_until(lambda: all_healthy(cluster.routers["push"].url))
    assert router.completions.create(model=MODEL, prompt="anyone there", max_tokens=2).choices[0].text


def test_a_backend_refusing_connections_is_retried_then_ejected(cluster):
    cluster.engines["decode-0"].kill()
    cluster.engines["prefill-1"].kill()
    for mode in ("push", "pull"):
        router = client_for(cluster.routers[mode].url)
        for index in range(6):
            raw = router.completions.with_raw_response.create(
                model=MODEL, prompt=f"retry {index}", max_tokens=2
            )
            assert raw.headers["x-pd-decode"] == "decode-1" and raw.headers["x-pd-prefill"] == "prefill-0"
            assert raw.parse().choices[0].text


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_prefill_restarted_at_the_same_address_serves_the_next_request_without_a_retry(cluster, mode):
    """Decode keeps each prefill's handshake; a restarted prefill answers at the same address with new
    agents. The first registration that reaches none of the old ones makes decode look it up again."""
    cluster.engines["decode-0"].kill()
    cluster.engines["prefill-1"].kill()
    router = cluster.routers[mode]
    wait_until(
        lambda: (
            backend_health(router.url)
            == {"prefill-0": True, "prefill-1": False, "decode-0": False, "decode-1": True}
        )
    )
    client = client_for(router.url)
    assert client.completions.create(model=MODEL, prompt="before", max_tokens=2).choices[0].text
    cluster.restart("prefill-0")
    wait_until(lambda: backend_health(router.url)["prefill-0"])
    retries = retries_counted(router.url)
    for index in range(3):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=f"after {index}", max_tokens=2)
        assert (raw.headers["x-pd-prefill"], raw.headers["x-pd-decode"]) == ("prefill-0", "decode-1")
        assert raw.parse().choices[0].text
    assert retries_counted(router.url) == retries


def test_client_disconnect_frees_blocks_on_both_engines(cluster):
    with httpx.Client(timeout=10) as http:
        body = {"model": MODEL, "prompt": "talk for a while", "max_tokens": 500, "stream": True}
        with http.stream("POST", cluster.routers["push"].url + "/v1/completions", json=body) as response:
            decode = cluster.engines[response.headers["x-pd-decode"]]
            # keep a reference: a discarded httpx line iterator closes the response
            lines = response.iter_lines()
            next(lines)
            assert decode.metrics()["pd_mock_kv_blocks_free"] < decode.metrics()["pd_mock_kv_blocks_total"]
    wait_until(lambda: blocks_all_free(cluster), timeout_s=3)
