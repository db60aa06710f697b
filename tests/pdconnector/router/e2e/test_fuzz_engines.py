"""The router fuzzed in front of mock engines moving real KV: only 4xx for bad input, never a 5xx or a hang,
and a normal request afterwards is served and equals the co-located answer."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
from pdconnector.router.config import DEFAULT_MAX_REQUEST_BODY_BYTES
from pdconnector.sim.cluster import LocalCluster

from tests.pdconnector.router.fuzz_cases import fuzz_cases

MODEL = "tiny"
CASES = 300


def _served(url: str, reference: str) -> None:
    response = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": "after the storm", "max_tokens": 6},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == reference


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_hostile_bodies_get_4xx_and_leave_the_router_serving(fast_cluster: LocalCluster, mode: str) -> None:
    url = fast_cluster.routers[mode].url
    reference = httpx.post(
        fast_cluster.engines["colocated"].url + "/v1/completions",
        json={"model": MODEL, "prompt": "after the storm", "max_tokens": 6},
        timeout=30,
    ).json()["choices"][0]["text"]
    statuses: Counter[int] = Counter()
    with httpx.Client(timeout=30) as client:
        for case in fuzz_cases(
            seed=17 if mode == "push" else 18,
            count=CASES,
            model=MODEL,
            max_body_bytes=DEFAULT_MAX_REQUEST_BODY_BYTES,
        ):
            response = client.post(
                url + case.path, content=case.body, headers={"Content-Type": "application/json"}
            )
            statuses[response.status_code] += 1
            assert response.status_code < 500, (case, response.text[:500])
            if response.status_code >= 400:
                assert response.json()["error"]["message"], (case, response.text[:500])
    assert (
        statuses[200] > 0 and sum(n for status, n in statuses.items() if 400 <= status < 500) > CASES // 2
    ), statuses
    _served(url, reference)
