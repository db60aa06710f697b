"""The whole request path on real engines: the router drives prefill and decode vLLM engines running our
connector.

The router is the real `pd-router` process with the config shape the operator renders; the engines are real
vLLM CPU engines moving KV over real NIXL. Output through the router equals the co-located output, and the
router counts the request as served with transferred KV (what the operator's KVTransferVerified condition
reads).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from pdconnector.protocol.params import TransferMode
from pdconnector.router.config import DEFAULT_MAX_REQUEST_BODY_BYTES, RouterConfig, dump_router_config
from pdconnector.sim.cluster import Process

from tests.pdconnector.router.fuzz_cases import fuzz_cases
from tests.pdconnector.vllm.harness import (
    LOOPBACK,
    Completion,
    complete,
    metric_sum,
    metric_total,
    output_differences,
    scrape_metrics,
    stream_token_ids,
)
from tests.pdconnector.vllm.pd_engines import (
    BLOCK_SIZE,
    MAX_TOKENS,
    PDPair,
    kv_cache_usage,
    pd_pair,
    prompt_of,
    reserve_ports,
    wait_for_free_blocks,
)

pytestmark = pytest.mark.slow


def router_config(pair: PDPair, mode: TransferMode) -> RouterConfig:
    def role(name: str, server_url: str, engine_id: str, side_channel_port: int) -> dict[str, object]:
        port = int(server_url.rsplit(":", 1)[1])
        return {
            "service": f"tiny-{name}",
            "namespace": "default",
            "http_port": port,
            "side_channel_port": side_channel_port,
            "replicas": 1,
            "backends": [{"name": f"tiny-{name}-0", "host": LOOPBACK, "engine_id": engine_id}],
        }

    return RouterConfig.model_validate(
        {
            "name": "tiny",
            "namespace": "default",
            "mode": mode.value,
            "served_model_name": "tiny",
            "compat_hash": "real-engines",
            "max_model_len": 2048,  # the harness's --max-model-len
            "prefill": role(
                "prefill", pair.prefill.url, pair.prefill_engine_id, pair.prefill_side_channel_port
            ),
            "decode": role("decode", pair.decode.url, "tiny-decode-0", 1),
        }
    )


# The local request that keeps decode's only sequence slot busy: ~4,000 tokens outlast the routed request's
# prefill and abort by seconds even at the ~300 tokens/s the tiny model decodes on an idle machine (1,500 did
# not: once the routed leg got the slot before the client left).
OCCUPIER_CONTEXT = 4096
OCCUPIER_PROMPT = 40
OCCUPIER_TOKENS = OCCUPIER_CONTEXT - OCCUPIER_PROMPT


@pytest.fixture(scope="module")
def engines(dense_model: Path, engine_log_dir: Path) -> Iterator[PDPair]:
    # Decode runs one sequence at a time, so a local request there keeps a routed decode leg queued without
    # blocks; its longer context lets that request outlast the routed one even on an idle machine.
    decode_args = ("--max-num-seqs", "1", "--max-model-len", str(OCCUPIER_CONTEXT))
    with pd_pair("routed-dense", dense_model, engine_log_dir, decode_args=decode_args) as pair:
        yield pair


@contextlib.contextmanager
def running_router(engines: PDPair, mode: TransferMode, workdir: Path) -> Iterator[Process]:
    config_path = workdir / "router.yaml"
    config_path.write_text(dump_router_config(router_config(engines, mode)))
    (port,) = reserve_ports(1)
    argv = [
        sys.executable,
        "-m",
        "pdconnector.router.main",
        "--config",
        str(config_path),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
    ]
    router = Process(
        "router",
        # CPU engines busy on 2 cores can take over a second to answer /health (an idle prefill was ejected
        # while decode ran a long local request, seen in CI); these tests are not about ejection
        [*argv, "--health-interval", "0.5", "--health-timeout", "10"],
        f"http://{LOOPBACK}:{port}",
        workdir / "router.log",
    )
    router.start()
    try:
        router.wait_healthy(120)
        yield router
    finally:
        router.stop()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_requests_through_the_router_equal_colocated_output_and_are_verified(
    engines: PDPair, mode: TransferMode, tmp_path: Path
) -> None:
    with running_router(engines, mode, tmp_path) as router:
        for seed, length in enumerate((BLOCK_SIZE + 1, 300)):
            prompt = prompt_of(length, seed + 7)
            expected = complete(engines.decode.url, prompt, max_tokens=MAX_TOKENS)
            routed = complete(router.url, prompt, max_tokens=MAX_TOKENS, timeout_s=300)
            assert output_differences(expected, routed, logprob_atol=1e-4) == [], (
                f"{mode} through the router, {length} tokens"
            )
        # Streamed through the router, token for token; vLLM's streams carry no kv_transfer_params, so it
        # proves nothing either way.
        prompt = prompt_of(BLOCK_SIZE + 5, 11)
        assert (
            stream_token_ids(router.url, prompt, max_tokens=MAX_TOKENS)
            == complete(engines.decode.url, prompt, max_tokens=MAX_TOKENS).token_ids
        )
        with urllib.request.urlopen(f"{router.url}/status", timeout=10) as response:
            transfers = json.loads(response.read())["transfers"]
        assert transfers == {"verified": 2, "unverified": 0, "unconfirmable": 1}
    assert wait_for_free_blocks(engines) == {"prefill": 0.0, "decode": 0.0}


FUZZ_CASES = 150


@pytest.mark.timeout(900)
def test_hostile_bodies_through_the_router_get_4xx_from_real_engines_and_leave_both_serving(
    engines: PDPair, tmp_path: Path
) -> None:
    statuses: Counter[int] = Counter()
    with running_router(engines, TransferMode.PUSH, tmp_path) as router, httpx.Client(timeout=60) as client:
        for case in fuzz_cases(
            seed=19, count=FUZZ_CASES, model="tiny", max_body_bytes=DEFAULT_MAX_REQUEST_BODY_BYTES
        ):
            response = client.post(
                router.url + case.path, content=case.body, headers={"Content-Type": "application/json"}
            )
            statuses[response.status_code] += 1
            assert response.status_code < 500, (case.kind, case.body[:300], response.text[:500])
        prompt = prompt_of(BLOCK_SIZE + 3, 13)
        routed = complete(router.url, prompt, max_tokens=MAX_TOKENS, timeout_s=300)
        assert (
            output_differences(
                complete(engines.decode.url, prompt, max_tokens=MAX_TOKENS), routed, logprob_atol=1e-4
            )
            == []
        )
    assert sum(n for status, n in statuses.items() if 400 <= status < 500) > FUZZ_CASES // 2, statuses
    assert wait_for_free_blocks(engines) == {"prefill": 0.0, "decode": 0.0}


def _sent(engines: PDPair) -> Counter[str]:
    """How prefill's transfers ended so far, by outcome."""
    text = scrape_metrics(engines.prefill.url)
    outcomes = ("written", "read", "cancelled", "expired", "failed", "rejected")
    return Counter(
        {
            o: int(metric_sum(text, "vllm:pd_kv_transfers", labels={"direction": "send", "outcome": o}))
            for o in outcomes
        }
    )


def _wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# what prefill would hold a transfer's blocks for if no abort reached it (pd_pair's transfer timeout)
LEASE_S = 30.0
# Freed on decode's abort, well before the lease: the outcome (cancelled, not expired) is the proof; the bound
# only has to tell the two apart on a loaded machine (CI saw 3.8 s between the client leaving and prefill's
# cache gauge showing the blocks freed, the gauge being updated at prefill's next logged step).
ABORT_BOUND_S = LEASE_S / 3


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL])
def test_a_client_leaving_while_decode_has_its_leg_queued_frees_prefill_at_once(
    engines: PDPair, mode: TransferMode, tmp_path: Path
) -> None:
    """Abort before allocation, through the router: decode's only sequence slot is busy with a local request,
    so the routed decode leg waits in vLLM's queue without blocks while prefill holds the computed KV for it.
    The client goes away; decode's connector sees the request end unallocated and tells prefill, which frees
    at once instead of at its lease. The local request is untouched, and both engines serve P/D traffic
    afterwards."""
    with running_router(engines, mode, tmp_path) as router, ThreadPoolExecutor(max_workers=1) as pool:
        before = _sent(engines)
        occupier = pool.submit(
            complete,
            engines.decode.url,
            prompt_of(OCCUPIER_PROMPT, 3),
            max_tokens=OCCUPIER_TOKENS,
            timeout_s=300,
        )
        # decode runs it (a gauge of the current step, not a cache usage an earlier request may have left)
        assert _wait_for(lambda: metric_total(engines.decode.url, "vllm:num_requests_running") >= 1, 60), (
            "the local request never started on decode"
        )
        prompts_before = metric_total(engines.prefill.url, "vllm:prompt_tokens")
        body = json.dumps(
            {
                "model": "tiny",
                "prompt": prompt_of(BLOCK_SIZE * 3 + 5, 21),
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
            }
        )
        client = http.client.HTTPConnection(LOOPBACK, int(router.url.rsplit(":", 1)[1]), timeout=60)
        client.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        # a counter, which no poll can miss (prefill's hold may be shorter than a scrape under load)
        assert _wait_for(
            lambda: metric_total(engines.prefill.url, "vllm:prompt_tokens") > prompts_before, 60
        ), "prefill never computed the routed request"
        # decode has the leg by now (push: sent with the prefill leg; pull: right after prefill answered)
        time.sleep(0.5)
        client.close()  # the client goes away
        left = time.monotonic()
        assert _wait_for(lambda: kv_cache_usage(engines.prefill) == 0, LEASE_S), "prefill kept the blocks"
        freed_after_s = time.monotonic() - left
        assert not occupier.done(), (
            "the local request ended before the test was over: the routed leg may have been allocated"
        )
        assert freed_after_s < ABORT_BOUND_S, (
            f"prefill freed {freed_after_s:.1f} s after the client left: at its lease, not on decode's abort "
            f"(prefill's transfers ended since: {dict(_sent(engines) - before)})"
        )
        assert _wait_for(lambda: sum((_sent(engines) - before).values()) == 1, 10)
        ended = _sent(engines) - before
        assert ended["expired"] == 0 and ended["written"] == 0 and ended["read"] == 0, ended
        local = occupier.result()
        assert len(local.token_ids) == OCCUPIER_TOKENS
        prompt = prompt_of(BLOCK_SIZE + 9, 22)
        routed = complete(router.url, prompt, max_tokens=MAX_TOKENS, timeout_s=300)
        assert (
            output_differences(
                complete(engines.decode.url, prompt, max_tokens=MAX_TOKENS), routed, logprob_atol=1e-4
            )
            == []
        )
    assert wait_for_free_blocks(engines) == {"prefill": 0.0, "decode": 0.0}


@pytest.mark.timeout(900)
def test_two_clients_sending_the_same_request_id_at_once_are_both_served_right(
    engines: PDPair, tmp_path: Path
) -> None:
    """A client-chosen ``X-Request-Id`` reused by concurrent requests: the router mints a transfer id per
    request, so neither takes the other's KV; both answers equal their co-located outputs."""
    prompts = [prompt_of(BLOCK_SIZE + 2, 31), prompt_of(2 * BLOCK_SIZE + 7, 32)]
    expected = [complete(engines.decode.url, prompt, max_tokens=MAX_TOKENS) for prompt in prompts]
    with running_router(engines, TransferMode.PUSH, tmp_path) as router:
        start = threading.Barrier(len(prompts))

        def send(prompt: list[int]) -> Completion:
            start.wait(timeout=30)
            return complete(router.url, prompt, max_tokens=MAX_TOKENS, request_id="reused-id", timeout_s=300)

        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            routed = list(pool.map(send, prompts))
        for want, got in zip(expected, routed, strict=True):
            assert output_differences(want, got, logprob_atol=1e-4) == []
        with urllib.request.urlopen(f"{router.url}/status", timeout=10) as response:
            assert json.loads(response.read())["transfers"]["verified"] == len(prompts)
    assert wait_for_free_blocks(engines) == {"prefill": 0.0, "decode": 0.0}
