"""Waiting on a local cluster: conditions polled to a deadline, and whether every engine has all its blocks
back."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable

from pdconnector.sim.cluster import LocalCluster, metric_samples


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def blocks_all_free(cluster: LocalCluster) -> bool:
    for engine in cluster.engines.values():
        if not engine.alive:
            continue
        samples = engine.metrics()
        if samples["pd_mock_kv_blocks_free"] != samples["pd_mock_kv_blocks_total"]:
            return False
    return True


def backend_health(router_url: str) -> dict[str, bool]:
    """Whether the router counts each backend (by name) healthy."""
    with urllib.request.urlopen(router_url + "/status", timeout=2) as response:
        return {b["name"]: b["healthy"] for b in json.loads(response.read())["backends"]}


def all_healthy(router_url: str) -> bool:
    return all(backend_health(router_url).values())


def retries_counted(router_url: str) -> float:
    """Every retry the router made, whatever its role and cause (``pd_router_retries_total``)."""
    return sum(v for k, v in metric_samples(router_url).items() if k.startswith("pd_router_retries_total"))
